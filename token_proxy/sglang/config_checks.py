"""Where SGLang contradicts a flag, a configuration error (ConfigMismatch: fatal at start-up, sglang/discovery.py).

--max-model-len over SGLang's context length: vLLM refuses a max_model_len over the model's at start-up, and every
long request would get SGLang's 400.

Is the proxy's tokenizer SGLang's? The proxy renders and encodes every prompt itself and SGLang only sees ids:
a tokenizer from another model would be served without a word, with wrong prompt_token_ids. At start-up (and
when SGLang answers again after an outage: it may have restarted on another model) a probe text is encoded on
both sides: a fixed text of words, digits, accents, CJK and emoji, then every added token the proxy's
tokenizer has (eos, chat markers, tool tags: its special tokens and the top of its vocabulary). SGLang encodes
it through its /v1/tokenize (every release from 0.5.17 has it) with add_special_tokens false, as the proxy
does. Different ids name both tokenizers (path, vocabulary size, eos) in one line; an SGLang with no
/v1/tokenize (older, or --skip-tokenizer-init) is compared by /model_info's tokenizer_path alone, with a warning.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import orjson

from token_proxy.errors import ProxyError
from token_proxy.sglang.client import SGLangClient

log = logging.getLogger(__name__)

PROBE = "Hello, world! The quick brown fox: 0123456789 -- héllo, naïve 你好 🙂\n\tdef f(x):\n\t\treturn x ** 2\n"
# The added tokens put into the probe (Qwen has 22, Llama 3 256 reserved ones: the first 128 say enough).
MAX_ADDED_IN_PROBE = 128
TIMEOUT_S = 30.0


class ConfigMismatch(Exception):
    """SGLang contradicts a flag (--max-model-len over its context, a tokenizer that is not its own)."""


def max_model_len(wanted: int | None, url: str, served: int) -> int:
    """--max-model-len when it is no larger than SGLang's context length (`served`), else ConfigMismatch."""
    if wanted and wanted > served:
        raise ConfigMismatch(f"User-specified max_model_len ({wanted}) is greater than the context length of SGLang "
                             f"at {url} ({served}): pass --max-model-len {served} or less, or start SGLang with "
                             f"--context-length {wanted}")
    return wanted or served


@dataclass(frozen=True, slots=True)
class Sides:
    """The probe's ids on each side, and what names each tokenizer."""

    ours: list[int]
    theirs: list[int]
    our_path: str
    their_path: str | None
    vocab_size: int
    eos: str | None


def probe_text(tokenizer) -> str:
    """The fixed text, then the tokenizer's added tokens (special or not), space-separated."""
    added = [token.content for _, token in sorted(tokenizer.added_tokens_decoder.items())][:MAX_ADDED_IN_PROBE]
    return PROBE + " ".join(added)


def encode_probe(tokenizer) -> tuple[str, list[int]]:
    """In an executor thread: the probe and the proxy's ids for it."""
    text = probe_text(tokenizer)
    return text, list(tokenizer.encode(text, add_special_tokens=False))


async def sglang_ids(client: SGLangClient, text: str) -> list[int] | None:
    """SGLang's ids for `text`, or None when it cannot tokenize (no /v1/tokenize, no tokenizer)."""
    body = orjson.dumps({"prompt": text, "add_special_tokens": False})
    status, raw, _ = await client.call("POST", "/v1/tokenize", body, TIMEOUT_S)
    if status != 200:
        log.warning("SGLang at %s does not tokenize (POST /v1/tokenize: HTTP %d): the proxy's tokenizer is compared "
                    "with SGLang's by /model_info's tokenizer_path only", client.base_url, status)
        return None
    try:
        tokens = orjson.loads(raw).get("tokens")
    except (orjson.JSONDecodeError, AttributeError):
        tokens = None
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        log.warning("SGLang at %s answered /v1/tokenize with no token list: the tokenizers are not compared",
                    client.base_url)
        return None
    return tokens


async def sglang_tokenizer_path(client: SGLangClient) -> str | None:
    """The tokenizer SGLang loaded (/model_info's tokenizer_path), or None if it does not say."""
    try:
        info = await client.get_json("/model_info")
    except ProxyError:
        return None
    path = info.get("tokenizer_path") if isinstance(info, dict) else None
    return path if isinstance(path, str) else None


def mismatch_line(sides: Sides) -> str | None:
    """None when the ids agree; else one line naming both tokenizers, where they part, and the fixes."""
    ours, theirs = sides.ours, sides.theirs
    if ours == theirs:
        return None
    at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    here = ours[at] if at < len(ours) else "the end"
    there = theirs[at] if at < len(theirs) else "the end"
    eos = f", eos {sides.eos!r}" if sides.eos else ""
    their_path = sides.their_path or "the one it loaded"
    return (f"the proxy's tokenizer {sides.our_path!r} ({sides.vocab_size} tokens{eos}) is not SGLang's "
            f"({their_path!r}, /model_info's tokenizer_path): a probe text is {len(ours)} ids here and "
            f"{len(theirs)} on SGLang, first differing at position {at} ({here} here, {there} on SGLang). "
            f"Pass --tokenizer with SGLang's tokenizer ({their_path}), or --allow-tokenizer-mismatch if you know "
            "the ids agree")


async def compare(client: SGLangClient, tokenizer, our_path: str, their_path: str | None, run) -> str | None:
    """The mismatch line, or None (the same ids, or SGLang cannot say). `run(fn, *args)` runs in the executor."""
    text, ours = await run(encode_probe, tokenizer)
    try:
        theirs = await sglang_ids(client, text)
    except ProxyError as exc:  # unreachable now: the next connect (or reconnect) compares again
        log.warning("cannot compare the tokenizer with SGLang's: %s", exc.message)
        return None
    if theirs is None:
        if their_path and our_path != their_path:
            log.warning("the proxy's tokenizer %r is not the path SGLang loaded (%r): make sure they are the same "
                        "tokenizer", our_path, their_path)
        return None
    eos = getattr(tokenizer, "eos_token", None)
    return mismatch_line(Sides(ours, theirs, our_path, their_path, len(tokenizer), eos if isinstance(eos, str) else None))


async def check_tokenizer(conn, picture, tokenizer) -> None:
    """The loaded tokenizer against the first generating server's (`conn`: discovery's Connection, `picture` its
    SGLangPicture): ConfigMismatch, or a warning under --allow-tokenizer-mismatch."""
    url = picture.worker_urls[0]
    client = conn.client if url == conn.client.base_url else conn.client.at(url)
    loop = asyncio.get_running_loop()
    problem = await compare(client, tokenizer, picture.agreed.tokenizer_path, await sglang_tokenizer_path(client),
                            lambda fn, *args: loop.run_in_executor(conn.executor, fn, *args))
    if problem and conn.settings.allow_tokenizer_mismatch:
        log.warning("%s (served all the same: --allow-tokenizer-mismatch)", problem)
    elif problem:
        raise ConfigMismatch(problem)


async def recheck_tokenizer(conn, on_fatal: Callable[[str], None] | None) -> None:
    """SGLang answers again after an outage (it may have restarted on another model): compare once more, and stop
    the proxy (on_fatal; every data route says why meanwhile) rather than serve another model's ids."""
    connected = conn.connected
    if connected is None:
        return
    try:
        await check_tokenizer(conn, connected.picture, connected.renderer.tokenizer)
    except ConfigMismatch as exc:
        conn.fatal = conn.last_error = f"after SGLang came back: {exc}"
        log.error("%s", conn.fatal)
        conn.connected = None
        if on_fatal is not None:
            on_fatal(conn.fatal)
    except (ProxyError, RuntimeError, OSError, ValueError) as exc:
        log.warning("cannot compare the tokenizer with SGLang's after the outage: %s", exc)


def rechecker(conn, on_fatal: Callable[[str], None] | None) -> Callable[[], None]:
    """A Connection back hook: recheck_tokenizer in a task (held until it ends)."""
    running: set[asyncio.Task] = set()

    def start() -> None:
        task = asyncio.get_running_loop().create_task(recheck_tokenizer(conn, on_fatal))
        running.add(task)
        task.add_done_callback(running.discard)

    return start
