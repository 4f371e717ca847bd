import unittest

from lru import LRUCache


class TestLRUCache(unittest.TestCase):
    def test_put_then_get(self):
        c = LRUCache(2)
        c.put("a", 1)
        self.assertEqual(c.get("a"), 1)

    def test_missing_is_none(self):
        self.assertIsNone(LRUCache(1).get("x"))

    def test_evicts_oldest(self):
        c = LRUCache(2)
        for k in "abc":
            c.put(k, k)
        self.assertIsNone(c.get("a"))
        self.assertEqual(c.get("c"), "c")
