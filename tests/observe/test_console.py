"""The operator console in a real headless Chromium (Debian's chromium + chromium-driver, driven
by Selenium) against the traced cluster of conftest.py (etcd, coordinator, P, D, gateway).

In order, as an operator would: sign in with the admin key and see the nodes (live refresh);
create a team and a key, use the key with the openai client, revoke it and see it refused;
see that team's usage in the charts and tables, and the CSV equal to `duet usage report`;
open a request's trace (the gateway's prefill and decode leg spans, and the P and D nodes' own);
see the autoscaler's decision on the Cluster page; the admin reads and cancels every team's
batches. A team key's session sees its own team only (and the API refuses it the rest), and a
POST without the CSRF token is refused. Screenshots go to $DUET_CONSOLE_SCREENSHOTS when set
(docs/console.md's images).

Under CI=true a missing browser is a failure, never a skip.
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from http.cookies import SimpleCookie
from pathlib import Path

import openai
import pytest

from gateway.console.pages.usage import ms_cell
from tests.gateway.helpers import ADMIN_KEY, http, make_team
from tests.observe.conftest import MODEL, Traced
from tests.wait import wait_for

CHROMIUM, DRIVER = (
    shutil.which("chromium") or "/usr/bin/chromium",
    shutil.which("chromedriver") or "/usr/bin/chromedriver",
)
TEAM = "webteam"
USAGE_TEAM = "usageteam"  # test_usage_charts_and_csv_equal_the_cli_report's own


def _browser_missing() -> str | None:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed"
    if not (os.path.exists(CHROMIUM) and os.path.exists(DRIVER)):
        return (
            "chromium / chromium-driver are not installed "
            "(apt-get install chromium chromium-driver)"
        )
    return None


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    missing = _browser_missing()
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the console's browser tests cannot run under CI=true: {missing}")
        pytest.skip(missing)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--window-size=1280,1000",
        "--disable-gpu",
        "--no-first-run",
    ):
        opts.add_argument(a)
    d = webdriver.Chrome(options=opts, service=Service(DRIVER))
    d.implicitly_wait(0)
    try:
        yield d
    finally:
        d.quit()


#: WCAG 2.1 contrast of every visible text against the background it is drawn on, as the
#: browser computed both: 4.5:1, or 3:1 for large text (18.66 px bold, 24 px)
_CONTRAST_JS = """
const lum = c => { const [r, g, b] = c.match(/[\\d.]+/g).slice(0, 3).map(Number).map(v => v / 255)
  .map(v => v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4);
  return 0.2126 * r + 0.7152 * g + 0.0722 * b; };
const opaque = c => { const m = c.match(/[\\d.]+/g);
  return m && (m.length < 4 || Number(m[3]) > 0); };
const bad = [];
for (const el of document.querySelectorAll("body *")) {
  if (![...el.childNodes].some(n => n.nodeType === 3 && n.textContent.trim())) continue;
  const st = getComputedStyle(el), r = el.getBoundingClientRect();
  if (st.visibility === "hidden" || r.width <= 1 || r.height <= 1) continue;  // not shown
  let bg = null;
  for (let a = el; a; a = a.parentElement) {
    const c = getComputedStyle(a).backgroundColor; if (opaque(c)) { bg = c; break; }
  }
  const [l1, l2] = [lum(st.color), lum(bg || "rgb(255, 255, 255)")].sort((x, y) => y - x);
  const ratio = (l1 + 0.05) / (l2 + 0.05), size = parseFloat(st.fontSize);
  const bold = Number(st.fontWeight) >= 700;
  const need = (size >= 24 || (bold && size >= 18.66)) ? 3 : 4.5;
  if (ratio < need) bad.push(`${el.tagName} "${el.textContent.trim().slice(0, 40)}" ` +
    `${st.color} on ${bg}: ${ratio.toFixed(2)}`);
}
return bad;
"""


def low_contrast(d: object) -> list[str]:
    """The texts of the page whose contrast is below WCAG AA (empty: every one passes)."""
    return d.execute_script(_CONTRAST_JS)  # type: ignore[attr-defined]


def shot(d: object, name: str) -> None:
    where = os.environ.get("DUET_CONSOLE_SCREENSHOTS")
    if where:
        Path(where).mkdir(parents=True, exist_ok=True)
        d.save_screenshot(str(Path(where) / f"{name}.png"))  # type: ignore[attr-defined]


def css(d: object, sel: str) -> list:  # type: ignore[type-arg]
    from selenium.webdriver.common.by import By

    return d.find_elements(By.CSS_SELECTOR, sel)  # type: ignore[attr-defined]


def sign_in(d: object, base: str, key: str) -> None:
    d.delete_all_cookies()  # type: ignore[attr-defined]
    d.get(base + "/console")  # type: ignore[attr-defined]
    wait_for(lambda: css(d, "input#key"), 10, "the sign-in form")
    css(d, "input#key")[0].send_keys(key)
    css(d, "form.login button")[0].click()
    wait_for(lambda: css(d, "form.signout"), 10, "a signed-in page")


def text(d: object) -> str:
    """The page's main text ("" while a click's navigation replaces the page)."""
    from selenium.common.exceptions import StaleElementReferenceException

    try:
        return d.execute_script(
            "const m = document.querySelector('main'); return m ? m.innerText : ''"
        )  # type: ignore[attr-defined]
    except StaleElementReferenceException:
        return ""


def stale(element: object) -> bool:
    """True once `element`'s page is gone (the browser moved on to the next one). Asked while
    the old document is being torn down, chromedriver may answer with an inspector error ("Node
    with given id does not belong to the document") instead of a stale reference: the same fact,
    seen mid-navigation (a CI run failed on it)."""
    from selenium.common.exceptions import StaleElementReferenceException, WebDriverException

    try:
        element.is_enabled()  # type: ignore[attr-defined]
    except StaleElementReferenceException:
        return True
    except WebDriverException as e:
        if "does not belong to the document" in str(e):
            return True
        raise
    return False


def cookie_header(d: object) -> str:
    return "; ".join(f"{c['name']}={c['value']}" for c in d.get_cookies())  # type: ignore[attr-defined]


def get_raw(url: str, cookie: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Cookie": cookie, **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_sign_in_and_see_the_nodes_live(traced: Traced, browser: object) -> None:
    d, base = browser, traced.gateway.url
    d.get(base + "/console/cluster")  # type: ignore[attr-defined]
    assert "/console/login" in d.current_url  # type: ignore[attr-defined]  # nothing without a key
    assert not low_contrast(d), low_contrast(d)  # WCAG AA on the sign-in page
    shot(d, "login")
    sign_in(d, base, ADMIN_KEY)
    assert d.current_url.endswith("/console/cluster")  # type: ignore[attr-defined]

    def node_rows() -> dict[str, str]:
        # read at once, in the page (the live refresh replaces these elements every 3 s)
        return {
            r.split()[0]: r
            for r in d.execute_script(  # type: ignore[attr-defined]
                "return [...document.querySelectorAll('#live table:first-of-type tbody tr')]"
                ".map(r => r.innerText)"
            )
        }

    # the engine column comes from the gateway's etcd view, which may read a node a refresh later
    wait_for(
        lambda: "native" in node_rows().get("decode-0", ""), 15, "decode-0's row with its engine"
    )
    rows = node_rows()
    assert {"prefill-0", "decode-0"} <= set(rows), rows
    assert (
        "prefill" in rows["prefill-0"]
        and "ready" in rows["decode-0"]
        and "native" in rows["decode-0"]
    )
    assert "Coordinator replicas" in text(d) and "etcd" in text(d)

    def stamp() -> str:
        return d.execute_script("return document.querySelector('#live p.muted').textContent")  # type: ignore[attr-defined]

    first = stamp()
    wait_for(lambda: stamp() != first, 15, "the live refresh")
    # Screen readers hear the node summary when it changes, not the tables every 3 s: the tables
    # are no live region, and a refresh announces the summary only if it changed.
    live = d.execute_script(
        "const l = document.getElementById('live'), s = document.getElementById('live-status');"  # type: ignore[attr-defined]
        "return [l.getAttribute('aria-live'), s.getAttribute('role'), s.textContent,"
        " l.querySelector('[data-summary]').getAttribute('data-summary')]"
    )
    assert live[:2] == [None, "status"] and live[2] in ("", live[3]), live  # the summary or nothing
    assert live[3].startswith(f"{len(rows)} nodes: ") and "ready" in live[3], live
    # the autoscaler's decision (conftest: prefill bounds [2, 3], the virtual actuator), through
    # the coordinator's API and on the page
    status, body = get_raw(
        traced.coordinator.url + "/planner", "", {"Authorization": f"Bearer {traced.secret}"}
    )
    assert status == 200, body
    out = [x for x in json.loads(body)["decisions"] if x["direction"] == "out"]
    assert out and out[-1]["role"] == "prefill" and out[-1]["reason"] == "below_min", out
    assert (out[-1]["current"], out[-1]["desired"], out[-1]["outcome"]) == (1, 2, "done"), out
    assert out[-1]["inputs"]["bounds"] == [2, 3]
    assert (
        json.loads((traced.tmp / "decision.json").read_text())["pools"][
            f"prefill/{out[-1]['model']}/shared"
        ]["replicas"]
        == 2
    )

    def decisions() -> list[str]:
        return d.execute_script(
            "return [...document.querySelectorAll('#planner-decisions tr')].map(r => r.innerText)"
        )  # type: ignore[attr-defined]

    wait_for(
        lambda: any(
            "scale out" in r and "below_min" in r and "1 → 2" in r and "done" in r
            for r in decisions()
        ),
        10,
        "the autoscaler's decision on the page",
    )
    row = next(r for r in decisions() if "scale out" in r)
    assert f"prefill/{out[-1]['model']}/shared" in row and "bounds 2–3" in row, row
    assert "virtual actuator" in text(d) and "Autoscaler pools" in text(d)
    assert not low_contrast(d), low_contrast(d)  # WCAG AA, as the browser renders it
    shot(d, "cluster")
    # keyboard: the first Tab reaches the skip link, Enter moves focus to the content
    from selenium.webdriver.common.keys import Keys

    d.get(base + "/console/cluster")  # type: ignore[attr-defined]
    css(d, "body")[0].send_keys(Keys.TAB)
    assert d.switch_to.active_element.text == "Skip to content"  # type: ignore[attr-defined]
    d.switch_to.active_element.send_keys(Keys.ENTER)  # type: ignore[attr-defined]
    wait_for(
        lambda: d.switch_to.active_element.get_attribute("id") == "main", 5, "focus on the content"
    )  # type: ignore[attr-defined]


def test_team_key_lifecycle_through_the_console(traced: Traced, browser: object) -> None:
    d, base = browser, traced.gateway.url
    sign_in(d, base, ADMIN_KEY)
    d.get(base + "/console/teams")  # type: ignore[attr-defined]
    form = css(d, "form[action='/console/teams']")[0]
    form.find_element("name", "id").send_keys(TEAM)
    form.find_element("name", "rpm").send_keys("600")
    form.find_element("name", "daily_budget_usd").send_keys("5")
    form.find_element("css selector", "button").click()
    wait_for(lambda: f"Team {TEAM} created" in text(d), 10, "the team")
    assert any(r.text.startswith(f"{TEAM} 600") for r in css(d, "table tbody tr"))
    # set its limits (PUT /admin/teams/{id}); every field has a label
    assert (
        d.execute_script(
            "return [...document.querySelectorAll('input:not([type=hidden]), select')]"  # type: ignore[attr-defined]
            ".filter(e => !e.labels || !e.labels.length).length"
        )
        == 0
    )
    from selenium.webdriver.support.select import Select

    form = css(d, "form[action='/console/teams/limits']")[0]
    Select(form.find_element("name", "id")).select_by_visible_text(TEAM)
    form.find_element("name", "rpm").send_keys("1200")
    form.find_element("css selector", "button").click()
    wait_for(lambda: f"Limits of team {TEAM} set" in text(d), 10, "the limits")
    assert http(f"{base}/admin/teams/{TEAM}")[2]["rpm"] == 1200
    # left empty: kept (an empty field once cleared the team's budget while only rpm was set)
    assert http(f"{base}/admin/teams/{TEAM}")[2]["daily_budget_usd"] == 5
    form = css(d, "form[action='/console/teams/limits']")[0]
    Select(form.find_element("name", "id")).select_by_visible_text(TEAM)
    form.find_element("name", "daily_budget_usd").send_keys("none")
    form.find_element("css selector", "button").click()
    wait_for(
        lambda: stale(form), 10, "the page after the second submit"
    )  # its text says "set" already
    wait_for(lambda: f"Limits of team {TEAM} set" in text(d), 10, "the limits again")
    assert http(f"{base}/admin/teams/{TEAM}")[2]["daily_budget_usd"] is None  # `none`: removed
    assert http(f"{base}/admin/teams/{TEAM}")[2]["rpm"] == 1200
    form = css(d, "form[action='/console/keys']")[0]
    Select(form.find_element("name", "team_id")).select_by_visible_text(TEAM)
    form.find_element("name", "name").send_keys("<b>console</b>")  # a name is text, never markup
    form.find_element("css selector", "button").click()
    wait_for(lambda: css(d, "#new-key"), 10, "the new key")
    assert "<b>console</b>" in text(d) and not css(d, "table b")
    key, key_id = css(d, "#new-key")[0].get_attribute("value"), css(d, "#new-key-id")[0].text
    assert key.startswith("sk-duet-") and key not in d.current_url  # type: ignore[attr-defined]
    assert not low_contrast(d), low_contrast(d)  # WCAG AA, as the browser renders it
    shot(d, "teams")
    # the key works with the official client
    client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
    for i in range(3):
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"console test {i} " * 4}],
            max_tokens=4,
            temperature=0,
        )
        assert r.usage.completion_tokens > 0
    # revoke it in the console: the API refuses it from then on
    d.get(base + "/console/teams")  # type: ignore[attr-defined]
    css(d, f"form[action='/console/keys/{key_id}/revoke'] button")[0].click()
    wait_for(lambda: f"Key {key_id} revoked" in text(d), 10, "the revocation")
    assert not css(d, f"form[action='/console/keys/{key_id}/revoke']")
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "refused"}], max_tokens=2
        )


def _cli_report(traced: Traced, day: str, group_by: str, team: str) -> str:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "duet",
            "usage",
            "report",
            "--store",
            f"sqlite://{traced.tmp / 'gateway.db'}",
            "--start",
            day,
            "--end",
            day,
            "--team",
            team,
            "--group-by",
            group_by,
            "--format",
            "csv",
        ],
        capture_output=True,
        timeout=60,
        check=True,
    )
    return out.stdout.decode()  # bytes: csv's \r\n line ends as they are


def test_usage_charts_and_csv_equal_the_cli_report(traced: Traced, browser: object) -> None:
    """Its own team and three requests (it once read the key lifecycle test's, and failed when
    run alone or on another worker)."""
    d, base = browser, traced.gateway.url
    key = make_team(base, USAGE_TEAM)
    client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
    for i in range(3):
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"usage test {i} " * 4}],
            max_tokens=4,
            temperature=0,
        )
    day = time.strftime("%Y-%m-%d", time.gmtime())

    def recorded() -> bool:
        data = http(f"{base}/v1/usage?date={day}&team_id={USAGE_TEAM}", key=ADMIN_KEY)[2]["data"]
        return bool(data) and data[0].get("requests") == 3

    wait_for(recorded, 30, "the three usage records")
    sign_in(d, base, ADMIN_KEY)
    q = urllib.parse.urlencode({"start": day, "end": day, "team": USAGE_TEAM})
    d.get(f"{base}/console/usage?{q}")  # type: ignore[attr-defined]
    tables = {t.find_element("css selector", "caption").text: t for t in css(d, "table")}
    team_row = tables["Per team"].find_element("css selector", "tbody tr").text.split()
    assert team_row[:2] == [USAGE_TEAM, "3"], team_row
    body = http(f"{base}/v1/usage?date={day}&team_id={USAGE_TEAM}", key=ADMIN_KEY)[2]
    tokens = body["data"][0]["total_tokens"]
    desc = css(d, "svg[aria-label='Tokens per day'] desc")[0].get_attribute("textContent")
    assert desc == f"{day}: {tokens}", desc  # the chart draws the API's numbers
    assert css(
        d,
        "svg[aria-label='Time to first token (ms)'] polyline, "
        "svg[aria-label='Time to first token (ms)'] circle",
    )
    assert not low_contrast(d), low_contrast(d)  # WCAG AA, as the browser renders it
    shot(d, "usage")
    # the tier table's row is the report's tier row (TTFT percentiles included), as the page
    # formats it
    [tier] = csv.DictReader(io.StringIO(_cli_report(traced, day, "tier", USAGE_TEAM)))
    cells = [c.text for c in tables["Per tier"].find_elements("css selector", "tbody td")]
    assert cells == [
        tier["tier"],
        tier["requests"],
        tier["prompt_tokens"],
        tier["completion_tokens"],
        tier["cached_tokens"],
        f"{float(tier['cost_usd']):.6f}",
        ms_cell(float(tier["ttft_p50_s"])),
        ms_cell(float(tier["ttft_p90_s"])),
    ], cells
    cookie = cookie_header(d)
    for group_by in ("record", "day", "tier", "model"):
        status, csv_bytes = get_raw(f"{base}/console/usage.csv?{q}&group_by={group_by}", cookie)
        assert status == 200
        assert csv_bytes.decode() == _cli_report(traced, day, group_by, USAGE_TEAM), group_by
    assert csv_bytes.count(b"\n") == 2  # header + one model row


def test_a_request_trace_shows_the_prefill_and_decode_legs(traced: Traced, browser: object) -> None:
    d, base = browser, traced.gateway.url
    raw = traced.client().chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Open my trace in the console, please. " * 3}],
        max_tokens=4,
        temperature=0,
    )
    rid = raw.headers["x-request-id"]
    sign_in(d, base, ADMIN_KEY)
    d.get(base + "/console/requests")  # type: ignore[attr-defined]
    links = css(d, f"a[href='/console/requests/{rid}']")
    assert links, text(d)
    assert not low_contrast(d), low_contrast(d)  # WCAG AA on the Requests page too
    shot(d, "requests")
    links[0].click()
    wait_for(lambda: "Timeline of" in text(d), 10, "the trace page")

    def names() -> list[str]:
        return [r.find_element("css selector", "td").text for r in css(d, "table tbody tr")]

    def with_node_spans() -> (
        bool
    ):  # D records its leg's spans as it answers: a reload may be needed
        if "decode.generate" in names():
            return True
        d.refresh()  # type: ignore[attr-defined]
        return False

    wait_for(with_node_spans, 15, "the decode node's spans on the trace page")
    for name in (
        "POST /v1/chat/completions",
        "gateway.auth",
        "gateway.quota.reserve",
        "gateway.route",
        "gateway.prefill_leg",
        "gateway.decode_leg",
        "gateway.usage.commit",
        # the nodes' own spans, read from their rings (gateway/console/node_spans.py)
        "prefill.queue",
        "prefill.compute",
        "prefill.hold",
        "decode.reserve",
        "decode.kv_pull",
        "decode.first_token",
        "decode.generate",
    ):
        assert name in names(), names()
    svg = css(d, "svg[role='img']")[0].get_attribute("outerHTML")
    assert "gateway.prefill_leg" in svg and "gateway.decode_leg" in svg
    assert "prefill.compute · prefill-0" in svg and "decode.kv_pull · decode-0" in svg
    assert not low_contrast(d), low_contrast(d)  # WCAG AA, the nodes' rows included
    # a list attribute reads as its items, not a Python tuple's repr
    nodes = next(
        dd.text
        for dt, dd in zip(css(d, "dl dt"), css(d, "dl dd"), strict=True)
        if dt.text == "duet.nodes"
    )
    assert nodes == "prefill-0, decode-0", nodes
    shot(d, "trace")


def test_a_team_key_sees_only_its_own_team(traced: Traced, browser: object) -> None:
    d, base = browser, traced.gateway.url
    other = make_team(base, "console-other")
    client = openai.OpenAI(base_url=base + "/v1", api_key=other, max_retries=0)
    client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "other team " * 4}], max_tokens=2
    )
    # the API: a team key reads its own usage only, and no admin endpoint
    assert http(f"{base}/v1/usage?team_id=observe", key=other)[0] == 403
    assert http(f"{base}/admin/teams", key=other)[0] == 401
    assert http(f"{base}/admin/keys", key=other)[0] == 401
    sign_in(d, base, other)
    assert d.current_url.endswith("/console/usage")  # type: ignore[attr-defined]
    assert "team console-other" in css(d, "form.signout")[0].text
    teams = [
        r.text.split()[0]
        for r in css(d, "table")
        if r.find_element("css selector", "caption").text == "Per team"
        for r in r.find_elements("css selector", "tbody tr")
    ]
    assert teams == ["console-other"], teams
    # a team's admin-wide filter is ignored: the API scopes the key
    d.get(base + f"/console/usage?team={TEAM}")  # type: ignore[attr-defined]
    assert TEAM not in text(d)
    d.get(base + "/console/cluster")  # type: ignore[attr-defined]
    assert "needs the admin key" in text(d)
    d.get(base + "/console/requests")  # type: ignore[attr-defined]
    assert "observe" not in [
        r.text.split()[2] for r in css(d, "table tbody tr") if len(r.text.split()) > 3
    ]
    cookie = cookie_header(d)
    assert get_raw(base + "/console/cluster", cookie)[0] == 403
    status, body = get_raw(f"{base}/console/usage.csv?group_by=team", cookie)
    assert (
        status == 200
        and body.decode().splitlines()[1].startswith("console-other,")
        and len(body.splitlines()) == 2
    )
    # the other team's trace is not shown to it
    gw_rid = next(
        s.attributes["duet.request_id"]
        for s in traced.receiver.spans
        if s.attributes.get("duet.team") == "observe" and "duet.request_id" in s.attributes
    )
    assert get_raw(f"{base}/console/requests/{gw_rid}", cookie)[0] == 404


def _batch(client: openai.OpenAI, n: int, max_tokens: int) -> str:
    lines = [
        {
            "custom_id": f"c-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"batch line {i}"}],
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            },
        }
        for i in range(n)
    ]
    f = client.files.create(
        file=("in.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()), purpose="batch"
    )
    return client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    ).id


def test_batches_show_progress_and_cancel(traced: Traced, browser: object) -> None:
    d, base, client = browser, traced.gateway.url, traced.client()
    small = _batch(client, 2, 2)
    wait_for(lambda: client.batches.retrieve(small).status == "completed", 60, "the small batch")
    big = _batch(
        client, 60, 32
    )  # one line at a time ([batch] concurrency = 1): long enough to cancel
    sign_in(d, base, traced.key)
    d.get(base + "/console/batches")  # type: ignore[attr-defined]
    rows = {r.text.split()[0]: r for r in css(d, "table tbody tr")}
    assert "completed" in rows[small].text and "2/2 (0 failed)" in rows[small].text
    assert rows[small].find_element("css selector", "progress").get_attribute("value") == "2"
    assert not low_contrast(d), low_contrast(d)  # WCAG AA on the Batches page too
    shot(d, "batches")
    css(d, f"form[action='/console/batches/{big}/cancel'] button")[0].click()
    wait_for(lambda: f"Batch {big}: cancel" in text(d), 10, "the cancellation")
    wait_for(lambda: client.batches.retrieve(big).status == "cancelled", 60, "the batch to stop")


def test_the_admin_reads_and_cancels_every_teams_batches(traced: Traced, browser: object) -> None:
    d, base, own = browser, traced.gateway.url, traced.client()
    other_key = make_team(base, "batch-other")
    other = traced.client(other_key)
    mine = _batch(own, 1, 2)
    theirs = _batch(other, 60, 32)  # one line at a time: long enough to cancel
    # the admin API: every team's batches with their team; a team key reaches none of it
    status, _, listed = http(f"{base}/admin/batches")
    assert status == 200, listed
    owners = {x["batch"]["id"]: x["team_id"] for x in listed["data"]}
    assert owners[mine] == "observe" and owners[theirs] == "batch-other", owners
    assert {x["team_id"] for x in http(f"{base}/admin/batches?team_id=batch-other")[2]["data"]} == {
        "batch-other"
    }
    assert http(f"{base}/admin/batches", key=other_key)[0] == 401
    assert http(f"{base}/admin/batches/{mine}/cancel", "POST", key=other_key)[0] == 401
    assert http(f"{base}/admin/batches?limit=0")[0] == 400
    assert http(f"{base}/admin/batches/batch_nope/cancel", "POST")[0] == 404
    # a team key still sees only its own team's batches, and cannot cancel another's
    assert [b.id for b in other.batches.list()] == [theirs]
    assert theirs not in [b.id for b in own.batches.list()]
    assert http(f"{base}/v1/batches/{mine}/cancel", "POST", key=other_key)[0] == 404
    # the console: the admin's Batches page lists both teams, and cancels the other team's
    sign_in(d, base, ADMIN_KEY)
    d.get(base + "/console/batches")  # type: ignore[attr-defined]
    rows = {r.text.split()[0]: r.text for r in css(d, "table tbody tr")}
    assert rows[mine].split()[1] == "observe" and rows[theirs].split()[1] == "batch-other", rows
    assert "Batches of every team" in text(d)
    shot(d, "batches-admin")
    css(d, f"form[action='/console/batches/{theirs}/cancel'] button")[0].click()
    wait_for(lambda: f"Batch {theirs}: cancel" in text(d), 10, "the admin's cancellation")
    wait_for(
        lambda: other.batches.retrieve(theirs).status == "cancelled",
        60,
        "the other team's batch to stop",
    )
    d.get(base + "/console/batches?team=observe")  # type: ignore[attr-defined]
    assert theirs not in text(d) and mine in text(d)
    # the other team's own session: its batch only, and no team column
    sign_in(d, base, other_key)
    d.get(base + "/console/batches")  # type: ignore[attr-defined]
    assert [r.text.split()[0] for r in css(d, "table tbody tr")] == [theirs]
    assert "Team" not in [h.text for h in css(d, "table thead th")]


def test_console_refuses_a_post_without_its_csrf_token(traced: Traced, browser: object) -> None:
    d, base = browser, traced.gateway.url
    sign_in(d, base, ADMIN_KEY)
    cookie = cookie_header(d)
    for data in (b"id=csrf-less", b"id=csrf-less&csrf=wrong"):
        req = urllib.request.Request(
            base + "/console/teams",
            data=data,
            method="POST",
            headers={"Cookie": cookie, "Content-Type": "application/x-www-form-urlencoded"},
        )
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 403
    assert "csrf-less" not in [t["id"] for t in http(f"{base}/admin/teams")[2]["data"]]
    # the sign-in form too (double-submit token), and the session cookie's attributes
    req = urllib.request.Request(
        base + "/console/login",
        data=b"key=" + ADMIN_KEY.encode(),
        method="POST",
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 403
    with urllib.request.urlopen(base + "/console/login", timeout=10) as r:
        assert "script-src 'self'" in r.headers["Content-Security-Policy"]
        pre = SimpleCookie(r.headers["Set-Cookie"])["duet_console_login"]
    assert pre["httponly"] and pre["samesite"] == "Strict"

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args: object) -> None:
            return None

    req = urllib.request.Request(
        base + "/console/login",
        method="POST",
        data=urllib.parse.urlencode({"key": ADMIN_KEY, "csrf": pre.value}).encode(),
        headers={
            "Cookie": f"duet_console_login={pre.value}",
            "Content-Type": "application/x-www-form-urlencoded",
        },
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.build_opener(NoRedirect).open(req, timeout=10)
    assert e.value.code == 303
    session = SimpleCookie(e.value.headers["Set-Cookie"])["duet_console"]
    assert (
        session["httponly"]
        and session["samesite"] == "Strict"
        and ADMIN_KEY not in e.value.headers["Set-Cookie"]
    )
