"""Rendering a webhook into robot markdown: the Jinja2 templates, their context, and fitting a
message into a robot's byte limit (steadyrl.services.alertbridge.bridge, Rendering and Limits)."""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jinja2

from .config import Webhook, WebhookAlert

TEMPLATES = Path(__file__).resolve().parent / "templates"


# ---------------------------------------------------------------------------- sizes

def utf8_len(text: str) -> int:
    return len(text.encode("utf-8"))


def cut_utf8(text: str, max_bytes: int) -> str:
    """The longest prefix of `text` whose UTF-8 encoding has at most `max_bytes` bytes.

    Cuts between characters, never inside one: the byte prefix may end in the middle of a
    multi-byte sequence, and decoding with errors="ignore" drops exactly that incomplete
    tail (the prefix of a valid encoding holds no other invalid sequence)."""
    data = text.encode("utf-8")
    if len(data) <= max_bytes:
        return text
    return data[:max(0, max_bytes)].decode("utf-8", errors="ignore")


def _plural(n: int, word: str = "alert") -> str:
    return f"{n} more {word}{'' if n == 1 else 's'}"


def omitted_note(omitted: int, max_bytes: int) -> str:
    """Appended when whole alerts are left out (by the bridge or by Alertmanager)."""
    return f"\n\n**… {_plural(omitted)} not shown** (message limit {max_bytes} bytes)" if omitted else ""


def cut_note(omitted: int, max_bytes: int) -> str:
    """Appended when the first alert itself is cut."""
    more = f"; {_plural(omitted)} not shown" if omitted else ""
    return f"\n\n**… truncated at {max_bytes} bytes{more}**"


# ---------------------------------------------------------------------------- rendering

def _time(t: datetime | None) -> str:
    if t is None or t.year <= 1:  # Alertmanager sends 0001-01-01T00:00:00Z for "no end yet"
        return ""
    if t.tzinfo is None:
        t = t.replace(tzinfo=UTC)
    return t.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _link(url: str) -> str:
    """An http(s) URL safe inside markdown `[...](url)`, else ""."""
    if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
        return ""
    return url.replace(" ", "%20").replace("(", "%28").replace(")", "%29")


#: Characters that make markdown structure (links, images, emphasis, headings, quotes, HTML, code,
#: tables), and the full-width forms alert text shows instead: read the same, render as text in
#: any robot's markdown (neither DingTalk nor WeCom documents backslash escapes).
_FULL_WIDTH = str.maketrans({"[": "［", "]": "］", "(": "（", ")": "）", "<": "＜", ">": "＞", "*": "＊",
                             "#": "＃", "`": "｀", "~": "～", "|": "｜", "!": "！", "\\": "＼"})
_EMPHASIS_UNDERSCORE = re.compile(r"(?<![0-9A-Za-z])_|_(?![0-9A-Za-z])")   # not inside snake_case
_MARKERS = str.maketrans({"-": "－", "+": "＋", "=": "＝", ".": "．"})
_LINE_MARKER = re.compile(r"^(\s*)([-+=]|\d+\.)", re.M)                      # list items, setext headings


def md_text(value: str, multiline: bool = False) -> str:
    """`value` (alert-supplied: a label, an annotation) as markdown that renders as this text:
    structure characters become their full-width forms, an emphasis underscore ＿, a line
    opening a list or heading gets a full-width marker; single-line values lose their newlines."""
    text = _EMPHASIS_UNDERSCORE.sub("＿", str(value).translate(_FULL_WIDTH))
    if not multiline:
        return " ".join(text.split("\n"))
    return _LINE_MARKER.sub(lambda m: m.group(1) + m.group(2).translate(_MARKERS), text)


def _md_labels(labels: dict[str, str]) -> dict[str, str]:
    return {k: md_text(v) for k, v in labels.items()}


def _md_annotations(annotations: dict[str, str]) -> dict[str, str]:
    return {k: md_text(v, multiline=True) for k, v in annotations.items()}


def render_context(hook: Webhook, alerts: list[WebhookAlert]) -> dict[str, Any]:
    """What the templates see.

    Group: status ("firing"/"resolved"), alertname (common, else grouped, else the names
    joined), severity (common label or ""), firing, resolved and total (counts over the
    whole group), receiver, group_labels, common_labels, common_annotations, external_url.
    alerts: the alerts shown, each {status, labels, annotations, startsAt, endsAt (UTC text,
    "" while firing), generatorURL ("" unless http/https), fingerprint}.
    Every alert-supplied text (names, labels, annotations, receiver) is `md_text`: markdown in
    an alert is shown as text, never rendered (a link, an image, a heading).
    """
    names = sorted({a.labels.get("alertname", "") for a in hook.alerts} - {""})
    alertname = hook.common_labels.get("alertname") or hook.group_labels.get("alertname") or ", ".join(names)
    return {
        "status": hook.status, "alertname": md_text(alertname or "alert"),
        "severity": md_text(hook.common_labels.get("severity", "")),
        "firing": sum(a.status == "firing" for a in hook.alerts),
        "resolved": sum(a.status == "resolved" for a in hook.alerts),
        "total": len(hook.alerts) + hook.truncated_alerts, "receiver": md_text(hook.receiver),
        "group_labels": _md_labels(hook.group_labels), "common_labels": _md_labels(hook.common_labels),
        "common_annotations": _md_annotations(hook.common_annotations), "external_url": _link(hook.external_url),
        "alerts": [{"status": a.status, "labels": _md_labels(a.labels), "annotations": _md_annotations(a.annotations),
                    "startsAt": _time(a.starts_at), "endsAt": _time(a.ends_at) if a.status == "resolved" else "",
                    "generatorURL": _link(a.generator_url), "fingerprint": a.fingerprint} for a in alerts],
    }


@dataclass
class Rendered:
    """One robot message: its markdown, how many alerts it shows, and whether it was shortened."""

    text: str
    title: str
    shown: int
    omitted: int  # alerts not shown: left out here plus Alertmanager's truncatedAlerts
    truncated: bool  # the bridge left alerts out or cut the text to fit the limit

    @property
    def bytes(self) -> int:
        return utf8_len(self.text)


class Renderer:
    """The Jinja2 templates, and fitting a rendered message into a byte limit.

    Raises:
        jinja2.TemplateError (from __init__): a template is missing or does not compile.
    """

    NAMES = ("dingtalk.md.j2", "dingtalk.title.j2", "wecom.md.j2")

    def __init__(self, templates_dir: Path | None = None):
        loaders: list[jinja2.BaseLoader] = [jinja2.FileSystemLoader(str(TEMPLATES))]
        if templates_dir is not None:
            loaders.insert(0, jinja2.FileSystemLoader(str(templates_dir)))
        # Markdown, not HTML: no autoescape. Block tags eat their own line.
        self.env = jinja2.Environment(loader=jinja2.ChoiceLoader(loaders), autoescape=False,
                                      trim_blocks=True, lstrip_blocks=True)
        self.templates = {name: self.env.get_template(name) for name in self.NAMES}

    def text(self, name: str, hook: Webhook, alerts: list[WebhookAlert]) -> str:
        return self.templates[name].render(**render_context(hook, alerts)).strip()

    def fit(self, name: str, hook: Webhook, max_bytes: int) -> Rendered:
        """Render `name` within `max_bytes` UTF-8 bytes (module doc, Limits)."""
        n, extra = len(hook.alerts), hook.truncated_alerts

        def attempt(k: int) -> str:
            return self.text(name, hook, hook.alerts[:k]) + omitted_note(n - k + extra, max_bytes)

        full = attempt(n)
        if utf8_len(full) <= max_bytes:
            return Rendered(full, "", n, extra, False)
        best: tuple[str, int] | None = None
        lo, hi = 1, n - 1  # the most leading alerts that fit, by bisection (size grows with k)
        while lo <= hi:
            mid = (lo + hi) // 2
            text = attempt(mid)
            if utf8_len(text) <= max_bytes:
                best, lo = (text, mid), mid + 1
            else:
                hi = mid - 1
        if best is not None:
            return Rendered(best[0], "", best[1], n - best[1] + extra, True)
        note = cut_note(n - 1 + extra, max_bytes)
        body = cut_utf8(self.text(name, hook, hook.alerts[:1]), max_bytes - utf8_len(note))
        return Rendered(body.rstrip() + note, "", 1, n - 1 + extra, True)

