"""GUI environments on kubernetes: Chromium in a pod driven by Playwright over CDP through forward(), on both
transports (pod IP and the API server's port-forward), and a desktop typing into a real X application."""

from __future__ import annotations

import pytest
from test_k8s_backend import config

import orchard
from gui_support import (
    BROWSER,
    browser_navigates_clicks_and_screenshots,
    desktop_drives_a_headed_browser,
    desktop_types_into_xterm,
)

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(240)]


@pytest.mark.parametrize("transport", ["direct", "port-forward"])
async def test_browser_navigates_clicks_and_screenshots(kubeconfig: str, k8s_namespace: str, transport: str) -> None:
    async with (
        orchard.Client(config(kubeconfig, k8s_namespace, transport=transport)) as client,
        client.sandbox(BROWSER, start_timeout=180) as sb,
    ):
        await browser_navigates_clicks_and_screenshots(sb)


async def test_desktop_types_into_xterm_and_drives_a_headed_browser(kubeconfig: str, k8s_namespace: str) -> None:
    async with (
        orchard.Client(config(kubeconfig, k8s_namespace)) as client,
        client.sandbox(BROWSER, start_timeout=180) as sb,
    ):
        await desktop_types_into_xterm(sb)
        await desktop_drives_a_headed_browser(sb)
