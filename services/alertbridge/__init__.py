"""alertbridge: Alertmanager webhooks in, DingTalk and WeCom group-robot markdown out (services.alertbridge.bridge)."""
