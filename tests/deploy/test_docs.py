"""docs/ stays short and true: links resolve, the rendered diagram matches its source, the messages in
troubleshooting.md are ones the code prints, every log event and metric the docs name exists, and the
quickstart's commands are the README's."""

from __future__ import annotations

import html
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.deploy.test_dashboards import exported

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
PAGES = sorted(DOCS.glob("*.md")) + [REPO / "README.md"]
SOURCE = "\n".join(p.read_text() for d in ("ledger", "consumer", "connector") for p in (REPO / d).rglob("*.py"))

# A distinctive piece of each message in docs/troubleshooting.md, as the code writes it.
MESSAGES = [
    "not created", "(or start with --migrate)", "no ledger at", "no source configured: give --engine-id",
    "config file", "belongs to engine", "give it another source_id", "cannot start publishing",
    "no subscriber on", "(create keys with `semkv-ledger keygen DIR --name NAME`)",
    "holds no secret key: pass the NAME.key_secret file written by", "has no curve_publisher_key, but curve_secret_key",
    "a CURVE client pins exactly one server key", "(not loopback) without CURVE",
    "can publish forged BlockStored/BlockRemoved events", "(Mode 4: approximate donor KV) is refused",
    "connector config file not found", "the executor must stop: TensorRT-LLM cannot recompute a promised load",
    "the engine recomputes the request's blocks", "after the promise; loading its secured, checksummed bytes",
]


def test_relative_links_resolve() -> None:
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).resolve().exists(), f"{page.name}: broken link {target}"


def test_every_page_is_in_the_index() -> None:
    index = (DOCS / "README.md").read_text()
    for page in DOCS.glob("*.md"):
        if page.name != "README.md":
            assert f"]({page.name})" in index, page.name


def _svg_texts(svg: str) -> list[str]:
    return sorted(" ".join(html.unescape(t).split()) for t in re.findall(r"<text[^>]*>([^<]*)</text>", svg))


def test_architecture_diagram_is_rendered_from_its_source(tmp_path: Path) -> None:
    source, svg, png = DOCS / "architecture.dot", DOCS / "architecture.svg", DOCS / "architecture.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "architecture.svg" in (DOCS / "architecture.md").read_text()
    labels = re.findall(r'label="([^"\\]*)', source.read_text())
    committed = svg.read_text()
    rendered = _svg_texts(committed)
    for label in labels:
        assert " ".join(label.split("\\n")[0].split()) in rendered, label
    if shutil.which("dot") is None:
        pytest.skip("Graphviz `dot` not installed (apt-get install graphviz): only the labels were compared")
    fresh = subprocess.run(["dot", "-Tsvg", str(source)], capture_output=True, text=True, check=True).stdout
    assert _svg_texts(fresh) == _svg_texts(committed), "re-render: dot -Tsvg architecture.dot -o architecture.svg"


def test_troubleshooting_messages_are_the_codes_messages() -> None:
    page = (DOCS / "troubleshooting.md").read_text()
    for message in MESSAGES:
        assert message in page, f"docs/troubleshooting.md lacks {message!r}"
        assert message in SOURCE, f"no code prints {message!r} any more: update docs/troubleshooting.md"


def test_log_events_named_in_the_docs_exist() -> None:
    prefixes = "source|curve|ledger|daemon|publisher|publish|replay|bridge"
    named = {e for page in PAGES for e in re.findall(rf"`((?:{prefixes})\.[a-z_]+)`", page.read_text())}
    assert len(named) >= 10
    for event in named:
        assert f'"{event}"' in SOURCE or f'.{event.split(".", 1)[1]}"' in SOURCE, event


def test_metrics_named_in_the_docs_exist() -> None:
    from connector.vllm_connector import EXTRA_CONFIG_KEY, EXTRA_SETTINGS_KEY

    names = exported()
    config_keys = {EXTRA_CONFIG_KEY, EXTRA_SETTINGS_KEY}  # vLLM's kv_connector_extra_config keys, not metrics
    for page in PAGES:
        for metric in set(re.findall(r"\b(semkv_[a-z0-9_]+)", page.read_text())) - config_keys:
            exists = metric in names or f"{metric}_count" in names  # a histogram is named by its base name
            assert exists, f"{page.name} names {metric}, which the code does not export"


def test_quickstart_commands_are_the_readmes() -> None:
    def commands(text: str) -> list[str]:
        block = re.search(r"```bash\n(.*?)```", text, re.DOTALL)
        assert block is not None
        return [line.split("#")[0].strip() for line in block.group(1).splitlines()][:2]

    assert commands((REPO / "README.md").read_text()) == commands((DOCS / "quickstart.md").read_text()) == [
        "make demo", "make test"]
