import unittest

from slugify import slugify


class TestSlugify(unittest.TestCase):
    def test_two_words(self):
        self.assertEqual(slugify("Hello World"), "hello-world")

    def test_lower_case(self):
        self.assertEqual(slugify("ABC"), "abc")

    def test_keeps_digits(self):
        self.assertEqual(slugify("Route 66"), "route-66")
