"""Moved to `custagg.app.cli`; this name is kept for existing callers."""

from custagg.app.cli import build_parser  # noqa: F401
from custagg.app.cli import main  # noqa: F401
