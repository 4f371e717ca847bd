"""A small web shop for GUI tasks: search, product pages, a cart and a checkout, its state as JSON.

    python3 shop.py 8000                        # serve on 127.0.0.1:8000
    python3 shop.py check '{"cart": {"mug-cobalt": 2}}' [8000]   # exit 0 if the running shop's state meets the goal

Standard library only (Python 3.11), so it runs in any image with python3.
Pages are plain HTML without JavaScript; the elements an agent acts on carry
``data-testid`` attributes (Playwright's ``page.get_by_test_id``) and stable
ids and names. ``/api/state`` serves the cart and the orders placed, which is
what a task's end state is read from.

Pages: ``/`` (a search box), ``/search?q=...&sort=relevance|price-asc|price-desc|rating-desc``,
``/product/<id>`` (quantity and "Add to cart", a POST to ``/cart/add``), ``/cart`` (items, totals,
"Remove" buttons posting to ``/cart/remove``), ``/checkout`` (name and address, a POST that places the
order and empties the cart), ``/order/<n>`` (the confirmation).
"""

from __future__ import annotations

import html
import json
import sys
import threading
import urllib.parse
import urllib.request
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class Product:
    id: str
    name: str
    category: str
    colour: str
    cents: int
    rating: float
    description: str


# id | name | category | colour | price | rating | description
_TABLE = """
mug-cobalt   | Cobalt Enamel Mug           | mug        | blue  |   9.50 | 4.2 | Enamel camping mug, 350 ml, light and chip resistant.
mug-navy     | Navy Stoneware Mug          | mug        | blue  |  12.00 | 4.7 | Stoneware mug, 400 ml, dishwasher safe.
mug-sky      | Sky Glass Mug               | mug        | blue  |  14.00 | 4.0 | Double-walled glass mug, 300 ml, keeps tea hot.
mug-ember    | Ember Ceramic Mug           | mug        | red   |   7.25 | 4.1 | Glazed ceramic mug, 330 ml.
mug-chalk    | Chalk Porcelain Mug         | mug        | white |   8.00 | 3.9 | Thin porcelain mug, 280 ml.
lamp-arc     | Arc LED Desk Lamp           | desk lamp  | black |  34.00 | 4.6 | Dimmable LED arm lamp, three colour temperatures.
lamp-halo    | Halo Desk Lamp              | desk lamp  | white |  52.00 | 4.8 | Ring light desk lamp with a wireless charging base.
lamp-pixel   | Pixel Clip Lamp             | desk lamp  | grey  |  19.00 | 4.1 | Clamps to a shelf or a monitor.
lamp-banker  | Brass Banker's Lamp         | desk lamp  | green |  39.99 | 4.3 | Green glass shade on a brass stand.
lamp-fold    | Fold Task Lamp              | desk lamp  | white |  28.50 | 4.4 | Folds flat; USB charging port in the base.
note-dot     | Dot Grid Notebook A5        | notebook   | green |   6.00 | 4.5 | 160 pages of dot grid, lay-flat binding.
note-lined   | Lined Notebook A5           | notebook   | black |   4.50 | 4.2 | 120 lined pages, elastic closure.
note-graph   | Graph Notebook A4           | notebook   | blue  |   7.25 | 4.0 | 100 pages of 5 mm squares.
note-sketch  | Sketch Book A4              | notebook   | white |  11.00 | 4.6 | Heavy paper for pencil and ink.
bag-trail    | Trail Daypack 20 L          | backpack   | green |  45.00 | 4.3 | Hip belt, rain cover, sleeve for a 15-inch laptop.
bag-metro    | Metro Laptop Backpack       | backpack   | black |  69.00 | 4.6 | Padded sleeve that fits a 16-inch laptop.
bag-roll     | Rolltop Backpack            | backpack   | red   |  79.00 | 4.4 | Waterproof rolltop with a 15-inch laptop sleeve.
bag-mini     | Mini City Backpack          | backpack   | blue  |  35.00 | 4.1 | A tablet pocket, no laptop sleeve.
head-studio  | Studio Over-Ear Headphones  | headphones | black |  89.00 | 4.5 | Wired, closed back, 3 m cable.
head-air     | Air Wireless Earbuds        | headphones | white |  59.00 | 4.2 | Bluetooth earbuds, 6 h battery.
head-quiet   | Quiet ANC Headphones        | headphones | blue  | 129.00 | 4.7 | Wireless, active noise cancelling.
tee-cotton   | Organic Cotton Tee          | t-shirt    | red   |  18.00 | 4.3 | Organic cotton, regular fit.
tee-heavy    | Heavyweight Tee             | t-shirt    | black |  24.00 | 4.5 | Thick 240 g cotton, boxy fit.
tee-linen    | Linen Blend Tee             | t-shirt    | blue  |  22.00 | 4.0 | Linen and cotton, cool in summer.
tee-everyday | Everyday Tee                | t-shirt    | white |  15.00 | 4.1 | Soft jersey, slim fit.
"""


def _product(row: str) -> Product:
    pid, name, category, colour, price, rating, description = (cell.strip() for cell in row.split("|"))
    dollars, cents = price.split(".")
    return Product(pid, name, category, colour, int(dollars) * 100 + int(cents), float(rating), description)


CATALOGUE: tuple[Product, ...] = tuple(_product(row) for row in _TABLE.strip().splitlines())
PRODUCTS = {p.id: p for p in CATALOGUE}
SORTS = {
    "relevance": None,
    "price-asc": lambda p: (p.cents, p.id),
    "price-desc": lambda p: (-p.cents, p.id),
    "rating-desc": lambda p: (-p.rating, p.id),
}
SORT_LABELS = {
    "relevance": "Relevance",
    "price-asc": "Price: low to high",
    "price-desc": "Price: high to low",
    "rating-desc": "Rating: high to low",
}
SWATCH = {"blue": "#2f5fb3", "red": "#c0392b", "white": "#f4f4f4", "black": "#222", "green": "#2e8b57", "grey": "#888"}


def money(cents: int) -> str:
    return f"${cents // 100}.{cents % 100:02d}"


def search(query: str, sort: str = "relevance") -> list[Product]:
    """Products whose name, category, colour or description hold every word of ``query``."""
    words = query.lower().split()
    found = [
        p for p in CATALOGUE if all(w in f"{p.name} {p.category} {p.colour} {p.description}".lower() for w in words)
    ]
    key = SORTS.get(sort)
    return sorted(found, key=key) if key else found


class Shop:
    """The shop's state: one cart and the orders placed, behind a lock (the server is threaded)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cart: dict[str, int] = {}
        self.orders: list[dict[str, Any]] = []

    def add(self, pid: str, qty: int) -> None:
        with self.lock:
            self.cart[pid] = self.cart.get(pid, 0) + qty

    def remove(self, pid: str) -> None:
        with self.lock:
            self.cart.pop(pid, None)

    def _items(self, cart: dict[str, int]) -> list[dict[str, Any]]:
        return [
            {"id": pid, "name": PRODUCTS[pid].name, "price": PRODUCTS[pid].cents / 100, "qty": qty}
            for pid, qty in cart.items()
        ]

    def place(self, name: str, address: str) -> int:
        with self.lock:
            items = self._items(self.cart)
            total = sum(PRODUCTS[pid].cents * qty for pid, qty in self.cart.items())
            number = len(self.orders) + 1
            self.orders.append({"id": number, "name": name, "address": address, "items": items, "total": total / 100})
            self.cart = {}
            return number

    def state(self) -> dict[str, Any]:
        with self.lock:
            total = sum(PRODUCTS[pid].cents * qty for pid, qty in self.cart.items())
            return {
                "cart": self._items(self.cart),
                "cart_total": total / 100,
                "orders": json.loads(json.dumps(self.orders)),
            }


STYLE = """
body { font-family: 'DejaVu Sans', sans-serif; margin: 0; background: #fafafa; color: #222; }
header { background: #2d6a4f; color: white; padding: 12px 24px; display: flex; gap: 24px; align-items: center; }
header a { color: white; text-decoration: none; font-weight: bold; }
header .brand { font-size: 22px; margin-right: auto; }
main { padding: 16px 24px; max-width: 900px; }
input, select, textarea, button { font-size: 16px; padding: 6px; }
button { background: #2d6a4f; color: white; border: 0; border-radius: 4px; cursor: pointer; }
ul.results { list-style: none; padding: 0; }
ul.results li { background: white; margin: 8px 0; padding: 10px; border-radius: 6px; display: flex; gap: 12px; align-items: center; }
.swatch { display: inline-block; width: 28px; height: 28px; border-radius: 50%; border: 1px solid #999; }
.big.swatch { width: 96px; height: 96px; }
.price { font-weight: bold; }
table { border-collapse: collapse; background: white; }
td, th { padding: 8px 12px; border-bottom: 1px solid #ddd; text-align: left; }
label { display: block; margin: 10px 0 4px; }
"""


def page(title: str, body: str, cart_count: int) -> bytes:
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)} - Orchard Shop</title>
<style>{STYLE}</style></head>
<body><header><a class="brand" href="/" data-testid="home-link">Orchard Shop</a>
<a href="/cart" id="cart-link" data-testid="cart-link">Cart (<span data-testid="cart-count">{cart_count}</span>)</a>
</header><main>
{body}
</main></body></html>""".encode()


def search_form(query: str = "", sort: str = "relevance") -> str:
    options = "".join(
        f'<option value="{s}"{" selected" if s == sort else ""}>{label}</option>' for s, label in SORT_LABELS.items()
    )
    return f"""<form id="search-form" action="/search" method="get" role="search">
<input id="search-input" name="q" type="search" value="{html.escape(query)}" placeholder="Search products" data-testid="search-input">
<select id="sort" name="sort" data-testid="sort">{options}</select>
<button type="submit" id="search-button" data-testid="search-button">Search</button>
</form>"""


def swatch(colour: str, big: bool = False) -> str:
    return f'<span class="{"big " if big else ""}swatch" style="background:{SWATCH.get(colour, "#ccc")}"></span>'


class Handler(BaseHTTPRequestHandler):
    shop: Shop  # set on a subclass by make_server()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass  # quiet: a sandbox keeps a process's output

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(url.query)
        path = url.path
        if path == "/":
            self.home()
        elif path == "/search":
            self.results(query.get("q", [""])[0], query.get("sort", ["relevance"])[0])
        elif path.startswith("/product/") and path[len("/product/") :] in PRODUCTS:
            self.product(PRODUCTS[path[len("/product/") :]])
        elif path == "/cart":
            self.cart_page()
        elif path == "/checkout":
            self.checkout_page()
        elif path.startswith("/order/"):
            self.order_page(path[len("/order/") :])
        elif path == "/api/state":
            self.send(HTTPStatus.OK, json.dumps(self.shop.state()).encode(), "application/json")
        else:
            self.html(HTTPStatus.NOT_FOUND, "Not found", "<h1>Not found</h1>")

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        form = {k: v[0] for k, v in urllib.parse.parse_qs(self.rfile.read(length).decode()).items()}
        if self.path == "/cart/add":
            pid, qty = form.get("product_id", ""), form.get("quantity", "1")
            if pid not in PRODUCTS or not qty.isdigit() or not 1 <= int(qty) <= 99:
                self.html(HTTPStatus.BAD_REQUEST, "Bad request", "<h1>No such product or quantity</h1>")
                return
            self.shop.add(pid, int(qty))
            self.redirect("/cart")
        elif self.path == "/cart/remove":
            self.shop.remove(form.get("product_id", ""))
            self.redirect("/cart")
        elif self.path == "/checkout":
            name, address = form.get("name", "").strip(), form.get("address", "").strip()
            if not name or not address or not self.shop.state()["cart"]:
                self.checkout_page("Give a name and an address, with something in the cart.")
                return
            self.redirect(f"/order/{self.shop.place(name, address)}")
        else:
            self.html(HTTPStatus.NOT_FOUND, "Not found", "<h1>Not found</h1>")

    # Pages

    def home(self) -> None:
        categories = sorted({p.category for p in CATALOGUE})
        links = " ".join(
            f'<a href="/search?q={urllib.parse.quote(c)}" data-testid="category-link">{html.escape(c)}</a>'
            for c in categories
        )
        body = f"<h1>Welcome</h1>{search_form()}<p>Browse: {links}</p>"
        self.html(HTTPStatus.OK, "Home", body)

    def results(self, query: str, sort: str) -> None:
        found = search(query, sort if sort in SORTS else "relevance")
        items = "".join(
            f"""<li data-testid="result" data-product-id="{p.id}" data-price="{p.cents / 100:.2f}" data-rating="{p.rating}">
{swatch(p.colour)}<a href="/product/{p.id}" data-testid="product-link">{html.escape(p.name)}</a>
<span class="price" data-testid="price">{money(p.cents)}</span>
<span data-testid="rating">{p.rating} &#9733;</span><span data-testid="colour">{p.colour}</span></li>"""
            for p in found
        )
        body = f"""{search_form(query, sort)}
<h2 data-testid="result-count">{len(found)} results for &ldquo;{html.escape(query)}&rdquo;</h2>
<ul class="results" id="results">{items}</ul>"""
        self.html(HTTPStatus.OK, f"Search: {query}", body)

    def product(self, p: Product) -> None:
        body = f"""<article data-testid="product" data-product-id="{p.id}">
<h1 data-testid="product-name">{html.escape(p.name)}</h1>
{swatch(p.colour, big=True)}
<p><span class="price" data-testid="product-price">{money(p.cents)}</span>
&middot; <span data-testid="product-rating">{p.rating} &#9733;</span>
&middot; <span data-testid="product-colour">{p.colour}</span>
&middot; <span data-testid="product-category">{p.category}</span></p>
<p data-testid="product-description">{html.escape(p.description)}</p>
<form id="add-form" action="/cart/add" method="post">
<input type="hidden" name="product_id" value="{p.id}">
<label for="quantity">Quantity</label>
<input id="quantity" name="quantity" type="number" min="1" max="99" value="1" data-testid="quantity">
<button type="submit" id="add-to-cart" data-testid="add-to-cart">Add to cart</button>
</form></article>"""
        self.html(HTTPStatus.OK, p.name, body)

    def cart_page(self) -> None:
        state = self.shop.state()
        rows = "".join(
            f"""<tr data-testid="cart-item" data-product-id="{i["id"]}" data-price="{i["price"]:.2f}">
<td>{html.escape(i["name"])}</td><td data-testid="cart-qty">{i["qty"]}</td>
<td>{money(round(i["price"] * 100))}</td><td>{money(round(i["price"] * 100) * i["qty"])}</td>
<td><form action="/cart/remove" method="post"><input type="hidden" name="product_id" value="{i["id"]}">
<button type="submit" data-testid="remove">Remove</button></form></td></tr>"""
            for i in state["cart"]
        )
        if rows:
            body = f"""<h1>Cart</h1><table id="cart"><tr><th>Item</th><th>Qty</th><th>Price</th><th>Total</th><th></th></tr>
{rows}</table>
<p>Total: <span class="price" data-testid="cart-total">{money(round(state["cart_total"] * 100))}</span></p>
<p><a href="/checkout" id="checkout-link" data-testid="checkout-link">Check out</a></p>"""
        else:
            body = '<h1>Cart</h1><p data-testid="cart-empty">Your cart is empty.</p>'
        self.html(HTTPStatus.OK, "Cart", body)

    def checkout_page(self, error: str = "") -> None:
        state = self.shop.state()
        count = sum(i["qty"] for i in state["cart"])
        warn = f'<p role="alert" data-testid="checkout-error">{html.escape(error)}</p>' if error else ""
        body = f"""<h1>Checkout</h1>{warn}
<p>{count} item{"" if count == 1 else "s"}, total <span class="price" data-testid="checkout-total">{money(round(state["cart_total"] * 100))}</span></p>
<form id="checkout-form" action="/checkout" method="post">
<label for="name">Name</label><input id="name" name="name" data-testid="name" size="40">
<label for="address">Address</label><textarea id="address" name="address" data-testid="address" rows="3" cols="40"></textarea>
<p><button type="submit" id="place-order" data-testid="place-order">Place order</button></p>
</form>"""
        self.html(HTTPStatus.BAD_REQUEST if error else HTTPStatus.OK, "Checkout", body)

    def order_page(self, number: str) -> None:
        orders = self.shop.state()["orders"]
        if not number.isdigit() or not 1 <= int(number) <= len(orders):
            self.html(HTTPStatus.NOT_FOUND, "Not found", "<h1>No such order</h1>")
            return
        order = orders[int(number) - 1]
        items = "".join(f"<li>{i['qty']} &times; {html.escape(i['name'])}</li>" for i in order["items"])
        body = f"""<h1 data-testid="order-confirmation">Order #{order["id"]} placed</h1>
<p>For {html.escape(order["name"])}, {html.escape(order["address"])}</p><ul>{items}</ul>
<p>Total: <span class="price">{money(round(order["total"] * 100))}</span></p>"""
        self.html(HTTPStatus.OK, f"Order {number}", body)

    # Replies

    def html(self, status: HTTPStatus, title: str, body: str) -> None:
        count = sum(i["qty"] for i in self.shop.state()["cart"])
        self.send(status, page(title, body, count), "text/html; charset=utf-8")

    def redirect(self, location: str) -> None:
        self.send_response(HTTPStatus.SEE_OTHER)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def send(self, status: HTTPStatus, data: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(data)


def make_server(port: int) -> ThreadingHTTPServer:
    """A server of a fresh shop on 127.0.0.1:``port`` (0: any free port), not yet serving."""
    handler = type("ShopHandler", (Handler,), {"shop": Shop()})
    return ThreadingHTTPServer(("127.0.0.1", port), handler)


# Goals: what a task's end state must be, checked against /api/state.


def check_state(goal: dict[str, Any], state: dict[str, Any]) -> tuple[bool, str]:
    """Whether ``state`` (as /api/state serves it) meets ``goal``, and why not.

    Goals: ``{"cart": {id: qty}}``, the cart holds exactly these; ``{"order": {"name": ..., "items":
    {id: qty}}}``, exactly one order was placed, by that name, of exactly these items.
    """
    if set(goal) - {"cart", "order"}:
        return False, f"unknown goal {sorted(goal)}"
    if "cart" in goal:
        cart = {i["id"]: i["qty"] for i in state["cart"]}
        if cart != goal["cart"]:
            return False, f"the cart holds {cart or 'nothing'}, not {goal['cart']}"
    if "order" in goal:
        want = goal["order"]
        orders = state["orders"]
        if len(orders) != 1:
            return False, f"{len(orders)} orders placed, not 1"
        order = orders[0]
        items = {i["id"]: i["qty"] for i in order["items"]}
        if items != want["items"]:
            return False, f"the order holds {items}, not {want['items']}"
        if order["name"] != want["name"]:
            return False, f"the order is in the name of {order['name']!r}, not {want['name']!r}"
    return True, "the shop's state meets the goal"


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "check":
        port = int(argv[2]) if len(argv) > 2 else 8000
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/state", timeout=10) as reply:
            state = json.load(reply)
        ok, why = check_state(json.loads(argv[1]), state)
        print(why)
        return 0 if ok else 1
    if len(argv) == 1 and argv[0].isdigit():
        make_server(int(argv[0])).serve_forever()
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
