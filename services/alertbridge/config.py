"""The alert bridge's settings (`alertbridge:`) and the Alertmanager webhook it accepts
(steadyrl.services.alertbridge.bridge documents the service)."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Literal, Self

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

from steadyrl.config import ServiceConfig, check_token_file, read_token

# ---------------------------------------------------------------------------- configuration

class AlertBridgeSection(BaseModel):
    """The alert bridge's own settings (`alertbridge:`)."""

    model_config = ConfigDict(extra="forbid")  # a typo is an error, not a silent default

    dingtalk_url: SecretStr | None = Field(
        None, description="DingTalk custom robot webhook, https://oapi.dingtalk.com/robot/send?access_token=... "
                          "(None: /alert/dingtalk answers 404). Secret: never logged.")
    dingtalk_secret: SecretStr | None = Field(
        None, description="The robot's 加签 secret (SEC...); when set, every request is signed. Secret: never logged.")
    wecom_url: SecretStr | None = Field(
        None, description="WeCom group robot webhook, https://qyapi.weixin.qq.com/cgi-bin/webhook/send?key=... "
                          "(None: /alert/wecom answers 404). Secret: never logged.")
    timeout_s: float = Field(5.0, gt=0, le=120, description="Per robot call: connect, each read, each write, seconds.")
    dingtalk_max_bytes: int = Field(20000, ge=256, le=20000,
                                    description="Largest markdown.text sent to DingTalk, UTF-8 bytes.")
    wecom_max_bytes: int = Field(4096, ge=256, le=4096,
                                 description="Largest markdown.content sent to WeCom, UTF-8 bytes (WeCom's limit).")
    retry_attempts: int = Field(3, ge=1, le=10, description="Attempts per notification in all (1: no retry).")
    retry_backoff_s: float = Field(1.0, ge=0, le=60, description="First wait before a retry, doubled each time.")
    retry_backoff_max_s: float = Field(10.0, ge=0, le=300, description="Longest wait between two attempts.")
    templates_dir: Path | None = Field(None, description="Folder with replacement templates (same file names).")
    max_webhook_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="Largest webhook body accepted (413 above).")
    dingtalk_per_minute: int = Field(20, ge=1, le=600, description="Messages a DingTalk robot takes per minute "
                                                                 "(DingTalk documents 20; past it the robot is "
                                                                 "throttled for 10 minutes).")
    wecom_per_minute: int = Field(20, ge=1, le=600, description="Messages a WeCom robot takes per minute "
                                                              "(WeCom documents 20).")
    critical_reserve: int = Field(5, ge=0, description="Of each minute's messages, how many only critical "
                                                       "notifications may use; the others are held and sent "
                                                       "as one summary when the quota allows.")
    critical_severities: list[str] = Field(["critical", "P0", "page"], description="severity label values that "
                                                                                 "make a notification critical.")
    token_file: Path | None = Field(
        None, description="A file holding the alert routes' own bearer token (a secret: `alert-token` of "
                          "deploy/secrets.sh). When set, POST /alert/* answer 401 without `Authorization: Bearer "
                          "<token>` (Alertmanager's webhook sends it); /livez, /readyz and /metrics stay open. "
                          "It opens the alert routes only: the bridge never holds the stack's work token "
                          "(http_token_file, which opens /generate and /score). None: no authentication.")

    @field_validator("token_file")
    @classmethod
    def _token_file_readable(cls, path: Path | None) -> Path | None:
        return check_token_file(path)

    def token(self) -> str | None:
        """The alert routes' bearer token (`token_file`), or None (no authentication)."""
        return read_token(self.token_file)

    @model_validator(mode="after")
    def _reserve_below_quota(self) -> Self:
        for robot in ("dingtalk", "wecom"):
            if self.critical_reserve >= getattr(self, f"{robot}_per_minute"):
                raise ValueError(f"critical_reserve {self.critical_reserve} >= {robot}_per_minute "
                                 f"{getattr(self, f'{robot}_per_minute')}: nothing else could ever be sent")
        return self


class AlertBridgeConfig(ServiceConfig):
    metrics_port: int = Field(8500, ge=0, le=65535, description="Port of the HTTP server (the webhook routes, "
                                                                "/livez, /readyz, /metrics); 0 picks a free one.")
    alertbridge: AlertBridgeSection = AlertBridgeSection()

    @field_validator("http_token_file")
    @classmethod
    def _no_work_token(cls, path: Path | None) -> Path | None:
        # the stack's work token opens the actor's /generate and the reward server's /score: a
        # bridge that held it (as every service did before issue 34) would hold their key
        if path is not None:
            raise ValueError("the alert bridge no longer takes the stack's work token (it opens /generate and "
                             "/score): its alert routes have a token of their own, alertbridge.token_file "
                             "(STEADYRL_ALERTBRIDGE__TOKEN_FILE; `make compose-secrets` and deploy/secrets.sh "
                             "write alert-token), which Alertmanager's webhook sends; unset http_token_file here")
        return path


# ---------------------------------------------------------------------------- the webhook

class WebhookAlert(BaseModel):
    """One alert of an Alertmanager webhook (unknown fields are ignored)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    status: Literal["firing", "resolved"]
    labels: dict[str, str]
    annotations: dict[str, str] = Field(default_factory=dict)
    starts_at: datetime = Field(alias="startsAt")
    ends_at: datetime | None = Field(None, alias="endsAt")
    generator_url: str = Field("", alias="generatorURL")
    fingerprint: str = ""


class Webhook(BaseModel):
    """Alertmanager's webhook body, version 4
    (prometheus.io/docs/alerting/latest/configuration/#webhook_config)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    version: Literal["4"]
    status: Literal["firing", "resolved"]
    alerts: list[WebhookAlert] = Field(min_length=1)
    receiver: str = ""
    group_key: str = Field("", alias="groupKey")
    truncated_alerts: int = Field(0, ge=0, alias="truncatedAlerts")
    group_labels: dict[str, str] = Field(default_factory=dict, alias="groupLabels")
    common_labels: dict[str, str] = Field(default_factory=dict, alias="commonLabels")
    common_annotations: dict[str, str] = Field(default_factory=dict, alias="commonAnnotations")
    external_url: str = Field("", alias="externalURL")


class WebhookRejected(Exception):
    """A webhook body the bridge refuses: `status` (400, 413, 422) and a message for the caller."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def parse_webhook(body: bytes) -> Webhook:
    """Validate a webhook body. Raises WebhookRejected 400 (not JSON) or 422 (fields named)."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WebhookRejected(400, f"body is not JSON: {e}") from None
    try:
        return Webhook.model_validate(data)
    except ValidationError as e:
        errors = [f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}" for err in e.errors()]
        more = f"; ... {len(errors) - 10} more" if len(errors) > 10 else ""
        raise WebhookRejected(422, "not an Alertmanager webhook (version 4): " + "; ".join(errors[:10]) + more) \
            from None

