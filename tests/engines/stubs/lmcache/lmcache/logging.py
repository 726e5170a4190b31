"""``lmcache.logging.init_logger``: a stdlib logger of that name."""

import logging as _logging


def init_logger(name: str) -> _logging.Logger:
    return _logging.getLogger(name)
