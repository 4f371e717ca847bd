import unittest

from intervals import merge


class TestMerge(unittest.TestCase):
    def test_empty(self):
        self.assertEqual(merge([]), [])

    def test_disjoint(self):
        self.assertEqual(merge([[1, 2], [4, 5]]), [[1, 2], [4, 5]])

    def test_overlapping(self):
        self.assertEqual(merge([[1, 3], [2, 6]]), [[1, 6]])
