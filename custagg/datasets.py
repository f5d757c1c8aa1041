"""Moved to `custagg.app.datasets` (application code); this name is kept for
existing callers (`from custagg import datasets`)."""

from custagg.app.datasets import *  # noqa: F401,F403
from custagg.app.datasets import __all__  # noqa: F401
