"""``python -m tilec``: the ``tilec`` command line (:mod:`tilec.cli`)."""
from .cli import entry

entry()
