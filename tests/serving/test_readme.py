"""The README as a newcomer follows it: the table of contents reaches every section, every in-page link
lands on a heading, the curl example gives the reply the README shows (run against the proxy on its
simulator), the launch and fleet command lines are ones the proxy accepts, and the quick-start snippets
compile (Python) or parse (TOML)."""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import shutil
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from token_proxy.cli import parse_settings

README = Path(__file__).resolve().parents[2] / "README.md"
FENCE = re.compile(r"^```(\S*)\s*$")


def readme_lines() -> list[str]:
    return README.read_text().splitlines()


def fenced_blocks() -> list[tuple[str, int, str]]:
    """(info string, 1-based line of the opening fence, text) of every fenced block."""
    blocks, info, start, body = [], None, 0, []
    for number, line in enumerate(readme_lines(), 1):
        match = FENCE.match(line)
        if info is None and match:
            info, start, body = match.group(1), number, []
        elif info is not None and line.strip() == "```":
            blocks.append((info, start, "\n".join(body) + "\n"))
            info = None
        elif info is not None:
            body.append(line)
    return blocks


def prose_lines() -> list[str]:
    """The README without its fenced blocks (a `#` comment in a shell block is no heading)."""
    lines, inside = [], False
    for line in readme_lines():
        if FENCE.match(line) or (inside and line.strip() == "```"):
            inside = not inside
            continue
        if not inside:
            lines.append(line)
    return lines


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (hyphens and underscores kept),
    each space a hyphen."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headings() -> list[tuple[int, str]]:
    return [(len(m.group(1)), m.group(2)) for line in prose_lines() if (m := re.match(r"^(#{1,6}) (.+)$", line))]


def anchors() -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, text in headings():
        slug = github_slug(text)
        out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return out


def toc_links() -> list[str]:
    """The anchors linked from the Contents list, in order."""
    lines = prose_lines()
    start = lines.index("**Contents**")
    end = next(i for i in range(start + 2, len(lines)) if not lines[i].strip())
    return re.findall(r"\]\(#([^)]+)\)", "\n".join(lines[start:end]))


def block_after(marker: str, info: str = "") -> str:
    """The first fenced block (of this info string) whose text starts with `marker`."""
    return next(text for kind, _, text in fenced_blocks() if kind == info and text.lstrip().startswith(marker))


# --- the table of contents and in-page links --------------------------------------------------------------

@pytest.mark.parametrize("heading, slug", [
    ("Several serving processes (`--workers N`)", "several-serving-processes---workers-n"),
    ("The trainer-side broadcaster (`token_proxy.broadcast`)", "the-trainer-side-broadcaster-token_proxybroadcast"),
    ("prime-rl's endpoints", "prime-rls-endpoints"),
    ("Fleet layout: router, workers, trainer", "fleet-layout-router-workers-trainer"),
    ("Testing on a real SGLang server (GPU)", "testing-on-a-real-sglang-server-gpu"),
])
def test_slugs_are_githubs(heading, slug):
    assert github_slug(heading) == slug


def test_the_readme_opens_with_make_run_and_make_test_then_the_contents():
    lines = readme_lines()
    assert lines[2] == "```" and lines[3].startswith("make run ") and lines[4].startswith("make test ")
    assert lines[5] == "```" and lines[7] == "**Contents**"


def test_the_contents_link_every_section_in_order_and_nothing_else():
    links = toc_links()
    assert sorted(set(links) - anchors()) == []
    sections = [github_slug(text) for level, text in headings() if level == 2]
    assert [link for link in links if link in sections] == sections
    frameworks = ["prime-rl-and-verifiers", "skyrl", "art-openpipe", "verl", "torchrl"]
    assert [link for link in links if link not in sections] == frameworks


def test_every_in_page_link_lands_on_a_heading():
    links = {link for line in prose_lines() for link in re.findall(r"\]\(#([^)]+)\)", line)}
    assert len(links) >= 20
    assert sorted(links - anchors()) == []


# --- the quick-start snippets -------------------------------------------------------------------------------

def test_every_python_snippet_compiles():
    snippets = [(start, text) for kind, start, text in fenced_blocks() if kind == "python"]
    assert len(snippets) >= 5
    for start, text in snippets:
        compile(text, f"README.md:{start}", "exec")


def test_every_toml_snippet_parses_and_points_at_the_proxy():
    tomllib = pytest.importorskip("tomllib")
    configs = [tomllib.loads(text) for kind, _, text in fenced_blocks() if kind == "toml"]
    prime_rl = next(c for c in configs if "orchestrator" in c)
    assert prime_rl["orchestrator"]["model"]["client"]["base_url"] == ["http://proxy-host:8000/v1"]
    assert prime_rl["weight_broadcast"] == {"type": "filesystem"}
    verifiers = next(c for c in configs if "client" in c)
    assert verifiers["client"]["type"] == "train" and verifiers["client"]["base_url"] == "http://proxy-host:8000/v1"


def test_skyrl_overrides_give_the_proxy_as_data_and_control_plane():
    overrides = dict(line.split("=", 1) for line in block_after("generator.").split())
    assert overrides == {
        "generator.inference_engine.run_engines_locally": "false",
        "generator.inference_engine.external_proxy_url": "http://proxy-host:8000",
        "generator.inference_engine.external_server_urls": "[http://proxy-host:8000]",
        "trainer.placement.colocate_all": "false"}


# --- the command lines -------------------------------------------------------------------------------------

def commands(block: str) -> list[list[str]]:
    return [shlex.split(line) for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_launch_line_has_what_the_proxy_needs_and_the_proxy_accepts_its_command():
    sglang, proxy = commands(block_after("python -m sglang.launch_server"))
    assert {"--enable-metrics", "--incremental-streaming-output"} <= set(sglang)
    assert proxy[0] == "token-proxy"
    settings = parse_settings(proxy[1:], environ={})
    assert urlsplit(settings.backend_url).port == int(flag(sglang, "--port"))
    assert settings.port == 8000


def test_the_fleet_lines_put_the_proxy_before_the_router_and_name_its_workers():
    *servers, router, proxy = commands(block_after("CUDA_VISIBLE_DEVICES=0"))
    assert all({"--enable-metrics", "--incremental-streaming-output"} <= set(s) for s in servers)
    assert [urlsplit(u).port for u in router[router.index("--worker-urls") + 1:]] == [
        int(flag(s, "--port")) for s in servers]
    settings = parse_settings(proxy[1:], environ={})
    assert urlsplit(settings.backend_url).port == int(flag(router, "--port"))
    assert settings.workers == tuple(router[router.index("--worker-urls") + 1:])


# --- the curl example, run -------------------------------------------------------------------------------

def curl_example() -> tuple[list[str], str, dict]:
    argv = shlex.split(block_after("curl ").replace("\\\n", " "))
    url = next(a for a in argv if a.startswith("http://"))
    return argv, url, json.loads(argv[argv.index("-d") + 1])


def documented_reply() -> str:
    return block_after('{\n  "model"')


def check_reply(reply: dict, body: dict) -> None:
    documented = documented_reply()
    for key in ("prompt_token_ids", "token_ids", "finish_reason", "weight_versions"):
        assert f'"{key}"' in documented
    choice = reply["choices"][0]
    assert reply["model"] == body["model"]
    assert len(reply["prompt_token_ids"]) == reply["usage"]["prompt_tokens"]
    assert len(choice["token_ids"]) == reply["usage"]["completion_tokens"] == body["max_tokens"]
    shown_prefix = json.loads(re.search(r'"prompt_token_ids": \[([\d, ]+), \.\.\.\]', documented).group(0)
                              .split(": ", 1)[1].replace(", ...", ""))
    assert reply["prompt_token_ids"][:len(shown_prefix)] == shown_prefix  # <|im_start|>user\n
    assert f'"finish_reason": "{choice["finish_reason"]}"' in documented
    assert f'"weight_versions": {json.dumps(choice["weight_versions"])}' in documented
    usage = {k: reply["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    assert f'"usage": {json.dumps(usage)}' in documented


async def test_the_curl_example_gives_the_documented_reply(make_sim, make_proxy):
    argv, url, body = curl_example()
    assert argv[0] == "curl" and urlsplit(url).port == 8000  # the proxy's default port
    assert body["temperature"] == 0  # greedy, so the documented finish and counts are the ones every run gets
    sim = await make_sim(served_model_name=body["model"])
    proxy = await make_proxy(sim)
    headers = dict(h.split(": ", 1) for h in (argv[i + 1] for i, a in enumerate(argv) if a == "-H"))
    response = await proxy.post(urlsplit(url).path, data=argv[argv.index("-d") + 1], headers=headers)
    assert response.status == 200, await response.text()
    reply = await response.json()
    check_reply(reply, body)
    if shutil.which("curl"):  # the README's own command, at this proxy's port
        live = str(proxy.make_url(urlsplit(url).path))
        process = await asyncio.create_subprocess_exec(
            *[live if a == url else a for a in argv], stdout=asyncio.subprocess.PIPE)
        out, _ = await asyncio.wait_for(process.communicate(), 30)
        assert process.returncode == 0
        check_reply(json.loads(out), body)
        assert json.loads(out)["choices"][0]["token_ids"] == reply["choices"][0]["token_ids"]  # greedy: the same


async def test_the_skyrl_limits_the_quick_start_names(proxy):
    """SkyRL's LoRA route is the proxy's (issue 39; tests/admin/test_skyrl_client.py), and its packed NCCL update
    is a 501."""
    quick_start = " ".join(README.read_text().split("### SkyRL", 1)[1].split("###", 1)[0].split())
    assert "the proxy serves SkyRL's own `POST /skyrl/v1/load_lora_adapter {lora_name, lora_path}`" in quick_start
    response = await proxy.post("/skyrl/v1/load_lora_adapter", json={"lora_name": "policy"})
    assert response.status == 400
    assert (await response.json())["error"]["message"] == "Both 'lora_name' and 'lora_path' must be provided."
    packed = {"method": "update_weights_nccl",
              "kwargs": {"update_info": {"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[8]], "packed": True}}}
    response = await proxy.post("/collective_rpc", json=packed)
    assert response.status == 501 and "packed buffers" in (await response.json())["error"]["message"]
