"""The web chat page at / in a real headless browser (Debian's chromium and chromium-driver,
driven by Selenium) against a real `kestrel serve` that needs an API key: the page asks for the
key, streams the answer, and shows what the openai client gets for the same greedy request.

Without chromium the test skips, unless CI=1 (or true) or KESTREL_REQUIRE_BROWSER=1: then it fails.
KESTREL_CHAT_SCREENSHOT=path saves a screenshot of the finished conversation (docs/chat-page.png).
"""

import os
import shutil

import pytest

from server_fixtures import HANG_S, shared_server

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
MAX_TOKENS = 64
PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGP4z8DwHwAFAAH/iZk9HQAAAABJRU5ErkJggg=="


def _browser_required() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true") or bool(
        os.environ.get("KESTREL_REQUIRE_BROWSER")
    )


def _find(*names: str) -> str | None:
    return next((path for path in map(shutil.which, names) if path), None)


@pytest.fixture(scope="module")
def browser():
    chromium, driver = _find("chromium", "chromium-browser"), _find("chromedriver")
    missing = not (chromium and driver)
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        missing = True
    if missing:
        message = "chromium, chromium-driver and selenium are needed (apt-get install chromium "
        message += "chromium-driver; pip install selenium)"
        if _browser_required():
            pytest.fail(message)
        pytest.skip(message)
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    options.add_argument("--window-size=1100,720")
    browser = webdriver.Chrome(service=Service(driver), options=options)
    browser.set_script_timeout(HANG_S)
    yield browser
    browser.quit()


def _wait(browser, condition):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(browser, HANG_S, poll_frequency=0.1).until(condition)


def test_page_asks_for_the_key_and_streams_the_greedy_answer(browser):
    from selenium.webdriver.common.by import By

    server = shared_server()
    expected = (
        server.client()
        .chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": QUESTION}],
            temperature=0,
            max_tokens=MAX_TOKENS,
        )
        .choices[0]
        .message.content
    )

    browser.get(server.url + "/")
    browser.execute_script("localStorage.clear()")
    browser.refresh()
    # the page's first call (/v1/models) gets 401: the key dialog opens
    dialog = browser.find_element(By.ID, "key-dialog")
    _wait(browser, lambda _: dialog.is_displayed())
    browser.find_element(By.ID, "api-key").send_keys(server.api_key)
    browser.find_element(By.ID, "key-save").click()
    _wait(browser, lambda b: b.find_element(By.ID, "model").text == "smollm2")

    _set(browser, "temperature", "0")
    _set(browser, "max-tokens", str(MAX_TOKENS))
    browser.find_element(By.ID, "input").send_keys(QUESTION)
    browser.find_element(By.ID, "send").click()
    _wait(
        browser, lambda b: b.find_element(By.TAG_NAME, "body").get_attribute("data-answers") == "1"
    )

    answer = browser.find_elements(By.CSS_SELECTOR, ".message.assistant .content")[-1]
    conversation = browser.execute_script("return window.kestrelChat.messages")
    assert conversation == [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": expected},
    ]
    assert answer.text == expected.strip()  # plain prose renders as itself
    assert browser.execute_script("return localStorage.getItem('kestrel.apiKey')") == server.api_key
    if os.environ.get("KESTREL_CHAT_SCREENSHOT"):
        browser.save_screenshot(os.environ["KESTREL_CHAT_SCREENSHOT"])


def _set(browser, element_id: str, value: str) -> None:
    from selenium.webdriver.common.by import By

    field = browser.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(value)


def test_an_attached_image_is_sent_as_an_image_url_part(browser, tmp_path):
    """The page sends the image as a data URL part; this text-only model refuses it (400), and
    the page shows the server's message."""
    import base64

    from selenium.webdriver.common.by import By

    server = shared_server()
    image = tmp_path / "dot.png"
    image.write_bytes(base64.b64decode(PNG))
    browser.get(server.url + "/")
    browser.execute_script("localStorage.setItem('kestrel.apiKey', arguments[0])", server.api_key)
    browser.refresh()
    browser.find_element(By.ID, "image").send_keys(str(image))
    _wait(browser, lambda b: b.execute_script("return window.kestrelChat.image") is not None)
    browser.find_element(By.ID, "input").send_keys("What is in this picture?")
    browser.find_element(By.ID, "send").click()
    error = _wait(browser, lambda b: b.find_elements(By.CSS_SELECTOR, ".message.error"))[0]
    assert error.text == "this model does not take images (image_url parts)"
    [sent] = browser.execute_script("return window.kestrelChat.messages")
    assert sent["content"][1]["image_url"]["url"] == "data:image/png;base64," + PNG


def test_page_renders_markdown_safely(browser):
    """Model output is text: HTML in it is shown, never run; code fences become <pre>."""
    server = shared_server()
    browser.get(server.url + "/")
    html = browser.execute_script(
        "return renderMarkdown(arguments[0])",
        "**bold** <img src=x onerror=alert(1)>\n\n```python\nprint('<b>')\n```\n- [a](javascript:x)",
    )
    assert "<strong>bold</strong>" in html
    assert "&lt;img src=x onerror=alert(1)&gt;" in html and "<img" not in html
    assert '<pre><code class="language-python">print(&#39;&lt;b&gt;&#39;)</code></pre>' in html
    assert "href" not in html  # only http(s) links become links


def test_the_page_needs_no_key_but_the_api_does():
    server = shared_server()
    status, page = server.get("/", headers={})
    assert status == 200 and "<title>kestrel chat</title>" in page
    assert "<script src" not in page and "@import" not in page and "https://" not in page
    assert server.post("/", {}, headers={})[0] == 401  # only GET is open
    assert server.get("/v1/models", headers={})[0] == 401
