"""``with`` for objects that hold a resource until ``close()``."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11


class Closing(abc.ABC):
    """``with obj:`` closes ``obj`` on leaving, whatever happened inside."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release what the object holds; safe to call twice."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
