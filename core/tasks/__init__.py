"""Built-in tasks; importing this package registers them in ``TASKS``.

A task is an object (here a module) exposing ``make_rows``, ``write_dataset``, ``corpus``
and ``sft_rows``.
"""

from polyrl.core.tasks import arithmetic

__all__ = ["arithmetic"]
