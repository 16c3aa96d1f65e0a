"""``python -m dspark_ops.train``: see :mod:`dspark_ops.train.trainer`."""

from .trainer import main

main()
