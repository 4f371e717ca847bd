import unittest

from median import median


class TestMedian(unittest.TestCase):
    def test_odd(self):
        self.assertEqual(median([3, 1, 2]), 2)

    def test_single(self):
        self.assertEqual(median([5]), 5)

    def test_empty_raises(self):
        self.assertRaises(ValueError, median, [])
