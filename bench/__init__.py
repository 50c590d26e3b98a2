"""hostpool_nb's benchmark: ``python -m bench`` (see ``bench/__main__.py``) and ``python -m bench.compare``."""
