"""A least-recently-used cache."""

from collections import OrderedDict


class LRUCache:
    """Holds up to ``capacity`` items; adding one more evicts the least recently used."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._data: OrderedDict[str, object] = OrderedDict()

    def get(self, key: str) -> object:
        """The value of ``key``, or None."""
        if key not in self._data:
            return None
        return self._data[key]

    def put(self, key: str, value: object) -> None:
        """Store ``value`` under ``key``."""
        self._data[key] = value
        self._data.move_to_end(key)
        if len(self._data) > self.capacity:
            self._data.popitem(last=False)
