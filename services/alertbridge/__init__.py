"""alertbridge: Alertmanager webhooks in, DingTalk and WeCom group-robot markdown out
(steadyrl.services.alertbridge.bridge)."""
