"""The page at / in a real headless Chromium: type, send, watch the reply stream and the cache view draw.

Needs Debian's chromium and chromium-driver (`make browser-deps`); skipped without them.
Set ATTNLAB_SCREENSHOT=PATH to keep the screenshot (`make browser-test` writes docs/figures/serve/page.png).
"""
from __future__ import annotations

import os
import shutil

import pytest

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def browser():
    webdriver = pytest.importorskip("selenium.webdriver")
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip("needs chromium and chromium-driver (make browser-deps)")
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1200,560"):
        opts.add_argument(flag)
    b = webdriver.Chrome(service=Service(driver), options=opts)
    yield b
    b.quit()


def test_page_streams_a_reply_and_draws_the_cache(browser, served, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    url, app = served
    browser.get(url + "/")
    assert "smollm2-135m" in browser.title
    Select(browser.find_element(By.ID, "policy")).select_by_visible_text("sink_h2o")
    browser.find_element(By.ID, "budget").send_keys("40")
    browser.find_element(By.ID, "max").clear()
    browser.find_element(By.ID, "max").send_keys("24")
    replies = []
    for turn, text in enumerate(["Tell me about the sea.", "And the mountains?"]):
        browser.find_element(By.ID, "input").send_keys(text)
        browser.find_element(By.ID, "send").click()
        # the reply streams in: text appears before the turn is done
        wait = WebDriverWait(browser, 120, poll_frequency=0.05)
        bubble = wait.until(lambda b: (b.find_elements(By.CSS_SELECTOR, ".assistant") + [None])[turn])
        partial = wait.until(lambda b: bubble.text or None)
        wait.until(lambda b: bubble.get_attribute("data-done") == "1")
        assert bubble.text.startswith(partial.rstrip()) and len(bubble.text) >= len(partial)
        replies.append(bubble.text)
    assert all(replies) and not browser.find_elements(By.CSS_SELECTOR, ".error")
    canvas = browser.find_element(By.ID, "view")
    assert int(canvas.get_attribute("data-drawn")) > 0 and int(canvas.get_attribute("data-heavy")) > 0
    stats = browser.find_element(By.ID, "stats").text
    assert "sink_h2o budget 40" in stats and "tokens seen" in stats
    # the page's conversation is one session on the server, reused on the second turn
    held = [h for h in app.state.store.sessions.values() if h.spec.policy == "sink_h2o"]
    assert len(held) == 1 and held[0].turns == 2 and len(held[0].session.cache) == 40
    # pixels: something other than the evicted grey and white was drawn
    colours = browser.execute_script("""
        const c = document.getElementById('view'), d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        const seen = new Set(); for (let i = 0; i < d.length; i += 4) seen.add(d[i] + ',' + d[i+1] + ',' + d[i+2]);
        return seen.size;""")
    assert colours >= 4
    shot = tmp_path / "page.png"
    browser.save_screenshot(str(shot))
    if os.environ.get("ATTNLAB_SCREENSHOT"):
        shutil.copy(shot, os.environ["ATTNLAB_SCREENSHOT"])
