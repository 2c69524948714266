"""`python -m steadyrl.local.probe [PATH]`: a container health check that needs no curl.

GETs `http://HOST:PORT/PATH` (default `/readyz` on 127.0.0.1) with the standard library only
and exits 0 on HTTP 200, 1 on any other status or when nothing answers, 2 for bad usage.
PORT is `--port`, else `$STEADYRL_METRICS_PORT` (the variable every service reads its HTTP
port from), so one HEALTHCHECK line in the image serves every service:

    HEALTHCHECK CMD ["python", "-m", "steadyrl.local.probe", "/readyz"]

It imports nothing from the services (a probe runs every few seconds: it must start fast).
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request

#: The routes every service serves (steadyrl.http.make_app); the probe refuses any other.
ROUTES = ("/livez", "/readyz", "/metrics")
PORT_ENV = "STEADYRL_METRICS_PORT"


def probe(path: str = "/readyz", port: int | None = None, host: str = "127.0.0.1",
          timeout_s: float = 4.0) -> tuple[bool, str]:
    """(ok, one-line detail) of one GET. ok only for HTTP 200.

    Raises:
        ValueError: no port given and `$STEADYRL_METRICS_PORT` unset or not a port number.
    """
    if port is None:
        raw = os.environ.get(PORT_ENV, "")
        if not raw.isdigit() or not 0 < int(raw) < 65536:
            raise ValueError(f"no port: give --port or set {PORT_ENV} (got {raw!r})")
        port = int(raw)
    url = f"http://{host}:{port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:  # noqa: S310 (http to localhost)
            return r.status == 200, f"{url} {r.status}"
    except urllib.error.HTTPError as e:  # 503 from /readyz: not ready; the body says why
        body = e.read(500).decode("utf-8", "replace")
        return False, f"{url} {e.code} {body}"
    except (urllib.error.URLError, OSError) as e:
        return False, f"{url} unreachable: {getattr(e, 'reason', e)}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m steadyrl.local.probe",
                                description="Exit 0 when the service answers 200 on PATH.")
    p.add_argument("path", nargs="?", default="/readyz", choices=ROUTES)
    p.add_argument("--port", type=int, default=None, help=f"default ${PORT_ENV}")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--timeout", type=float, default=4.0, help="seconds")
    args = p.parse_args(argv)
    try:
        ok, detail = probe(args.path, args.port, args.host, args.timeout)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(detail, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
