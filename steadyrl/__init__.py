"""steadyrl: RL post-training (GRPO, PPO) for LLMs as services over Kafka (README.md).

`steadyrl.__version__` is the installed package's version (pyproject.toml), `0+unknown` when the
package is imported from a folder that was never installed. `steadyrl.up(...)` and
`steadyrl.Run` start and follow a run from Python (steadyrl/api.py).
"""

from importlib.metadata import PackageNotFoundError, version
from typing import Any

try:
    __version__ = version("steadyrl")
except PackageNotFoundError:   # a plain folder on sys.path, no installed metadata
    __version__ = "0+unknown"

__all__ = ["Run", "RunFailed", "__version__", "up"]


def __getattr__(name: str) -> Any:
    """steadyrl.up, Run, RunFailed, imported on first use: every service imports this package."""
    if name in ("up", "Run", "RunFailed"):
        from steadyrl import api  # lazy: httpx and the run handle; services never need them

        return getattr(api, name)
    raise AttributeError(f"module 'steadyrl' has no attribute {name!r}")
