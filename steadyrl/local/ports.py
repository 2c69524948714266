"""Who holds a TCP port on this machine: what `steadyrl up` checks before it starts anything.

`taken(port)` says whether a listening socket would stop a bind of 127.0.0.1:port (a listener
on 127.0.0.1 or on every interface, IPv4 or IPv6); `holders(port)` names the processes that
listen on it, from /proc/net/tcp{,6} and each process's open sockets (Linux; a process of
another user shows as "a process of another user", since its files are not ours to read).
"""

from __future__ import annotations

import errno
import os
import socket
from dataclasses import dataclass
from pathlib import Path

_LISTEN = "0A"


@dataclass(frozen=True)
class Holder:
    """A process listening on a port: its pid (None: unreadable, another user's) and command
    line (a long one shortened in its middle, to about 200 characters)."""

    pid: int | None
    cmdline: str

    def __str__(self) -> str:
        return "a process of another user" if self.pid is None else f"pid {self.pid} ({self.cmdline})"


def taken(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a bind of `host`:`port` fails because the address is in use (SO_REUSEADDR, as
    the services and Kafka bind: a closed connection in TIME_WAIT does not count)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return True
            raise
    return False


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == _LISTEN and int(f[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f[9])
    return inodes


def pid_alive(pid: int) -> bool:
    """True when a process with this pid runs (one we may not signal counts as alive; a zombie
    does not: it still answers kill(0), so its state is read from /proc)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def cmdline(pid: int) -> str:
    """`pid`'s whole command line, its arguments joined by spaces (bytes that are not UTF-8
    replaced); "" when it cannot be read (the process ended, or is another user's)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _short(cmd: str) -> str:
    """A command line for a message: a long one as its first 60 and last 140 characters (a JVM's
    class path is long; its main class and arguments, e.g. a broker's server.properties, are
    last); "?" for an unreadable one."""
    if not cmd:
        return "?"
    return cmd if len(cmd) <= 200 else f"{cmd[:60]} ... {cmd[-140:]}"


def holders(port: int) -> list[Holder]:
    """The processes listening on TCP `port` (any address), in pid order; one Holder with pid
    None stands for listeners whose process could not be read (another user's). [] when no
    socket listens there."""
    inodes = _listening_inodes(port)
    if not inodes:
        return []
    found: dict[int, Holder] = {}
    seen: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fds = list((proc / "fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                link = fd.readlink().name
            except OSError:
                continue
            if link.startswith("socket:[") and link[8:-1] in inodes:
                seen.add(link[8:-1])
                pid = int(proc.name)
                found.setdefault(pid, Holder(pid, _short(cmdline(pid))))
    out = [found[p] for p in sorted(found)]
    if seen != inodes:
        out.append(Holder(None, ""))
    return out


def describe(port: int) -> str:
    """What holds `port`, in words: "pid 12 (java ... kafka.Kafka ...)", several joined with
    " and ", or "an unknown process" when none is found (it closed a moment ago)."""
    hs = holders(port)
    return " and ".join(str(h) for h in hs) if hs else "an unknown process"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def free_port_pair() -> int:
    """A port p on 127.0.0.1 with p + 1 also free a moment ago: `steadyrl up --port p` (and the
    benches) put the KRaft controller on p + 1."""
    while True:
        p = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 1))
                return p
            except OSError:
                continue
