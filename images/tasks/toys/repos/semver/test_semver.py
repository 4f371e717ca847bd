import unittest

from semver import compare


class TestCompare(unittest.TestCase):
    def test_equal(self):
        self.assertEqual(compare("1.2.3", "1.2.3"), 0)

    def test_major(self):
        self.assertEqual(compare("2.0.0", "1.0.0"), 1)

    def test_patch_lower(self):
        self.assertEqual(compare("1.0.0", "1.0.1"), -1)
