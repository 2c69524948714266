"""steadyrl: RL post-training (GRPO, PPO) for LLMs as services over Kafka (README.md).

`steadyrl.__version__` is the installed package's version (pyproject.toml), `0+unknown` when the
package is imported from a folder that was never installed.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("steadyrl")
except PackageNotFoundError:   # a plain folder on sys.path, no installed metadata
    __version__ = "0+unknown"

__all__ = ["__version__"]
