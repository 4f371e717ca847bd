import unittest

from roman import to_roman


class TestRoman(unittest.TestCase):
    def test_one(self):
        self.assertEqual(to_roman(1), "I")

    def test_three(self):
        self.assertEqual(to_roman(3), "III")

    def test_twenty_six(self):
        self.assertEqual(to_roman(26), "XXVI")

    def test_rejects_zero(self):
        self.assertRaises(ValueError, to_roman, 0)
