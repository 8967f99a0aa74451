"""A table keyed by id(obj), read on the hot path of every hook."""
import weakref


class ById(dict):
    """id(obj) -> value, each entry dropped when its object is collected. Reads are a plain dict's
    (``get``, ``in``, ``[]``): a WeakKeyDictionary makes a weakref per lookup, and a tensor compares
    elementwise, so it cannot key one. Holds no reference to the objects it is keyed by."""

    __slots__ = ("__weakref__", )

    def put(self, obj, value):
        """``value`` for ``obj``; the first put of ``obj`` registers the drop of its entry."""
        key = id(obj)
        if key not in self:
            weakref.finalize(obj, self.pop, key, None).atexit = False
        self[key] = value
        return value
