"""What each SGLang release changed that the proxy could depend on, read from the released wheels.

    python bench/sglang_audit.py                 # every release from 0.5.17 to the newest on PyPI
    python bench/sglang_audit.py --offline       # only the wheels already in the cache

For each release it downloads the sglang wheel alone (`pip download --no-deps`, cached in --cache, default
~/.cache/sglang-audit) and, without importing sglang (no torch, no GPU), parses its sources with `ast`:

- routes: method + path of every FastAPI decorator in sglang/srt/entrypoints/http_server.py, and the request
  class each route's handler takes (its parameter annotations);
- requests: the fields (type, default) of those classes in sglang/srt/managers/io_struct.py (dataclasses
  before 0.5.21, msgspec Structs after: both are annotated class bodies, bases followed), and the keyword
  arguments of SamplingParams.__init__ (sglang/srt/sampling/sampling_params.py: the `sampling_params` keys);
- refusals: what the scheduler, the model runner's weight updater and the tokenizer manager answer instead of
  doing the work: `success=False` replies with their message, `raise ...(message)` and `assert ..., message`.

Then it diffs each release against the one before and writes bench/SGLANG_VERSIONS.md (the diff, for people;
the README's "SGLang versions" table is drawn from it) and bench/sglang_versions.json (everything, for
machines). Run it again when a release appears, and commit both files.
"""

from __future__ import annotations

import argparse
import ast
import itertools
import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

OLDEST = "0.5.17"
HERE = Path(__file__).resolve().parent
HTTP_SERVER = "sglang/srt/entrypoints/http_server.py"
IO_STRUCT = "sglang/srt/managers/io_struct.py"
SAMPLING = "sglang/srt/sampling/sampling_params.py"
API_TYPES = "sglang/api/v1/api_types.py"  # 0.5.22+: /generate's wire contract (unknown keys are a 400)
REFUSAL_FILES = (
    "sglang/srt/managers/scheduler_components/weight_updater.py",
    "sglang/srt/model_executor/model_runner_components/weight_updater.py",
    "sglang/srt/managers/tokenizer_manager.py",
    "sglang/srt/managers/tokenizer_control_mixin.py",
)
# The native routes the proxy calls itself, or that its clients call through it (prime-rl, vLLM's RL API,
# TorchRL, SkyRL, routers); marked in the output. Every other route is still listed and diffed.
PROXY_ROUTES = frozenset({
    "/generate", "/abort_request", "/pause_generation", "/continue_generation", "/flush_cache",
    "/update_weights_from_disk", "/init_weights_update_group", "/update_weights_from_distributed",
    "/update_weights_from_tensor", "/destroy_weights_update_group", "/update_weight_version",
    "/begin_weight_update", "/end_weight_update", "/release_memory_occupation", "/resume_memory_occupation",
    "/get_weights_by_name", "/weights_checker", "/model_info", "/get_model_info", "/server_info",
    "/get_server_info", "/v1/loads", "/get_load", "/load_lora_adapter", "/unload_lora_adapter", "/health",
    "/health_generate", "/v1/models", "/metrics", "/ready",
})
HTTP_METHODS = ("get", "post", "put", "delete", "patch")
_RELEASE = re.compile(r"^\d+\.\d+\.\d+(\.post\d+)?$")


# --- extraction (pure: source text in, plain data out) ---------------------------------------------------

def routes(source: str) -> list[dict]:
    """Every `@<app>.get/post/put/delete/patch(path)` and `@<app>.api_route(path, methods=[...])` on a function:
    [{"method", "path", "handler", "params": [annotation names of its parameters]}], sorted."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        names = sorted({n.id for arg in node.args.args + node.args.kwonlyargs if arg.annotation is not None
                        for n in ast.walk(arg.annotation) if isinstance(n, ast.Name)})
        for decorator in node.decorator_list:
            for method, path in _route_of(decorator):
                out.append({"method": method, "path": path, "handler": node.name, "params": names})
    return sorted(out, key=lambda r: (r["path"], r["method"]))


def _route_of(decorator: ast.expr) -> list[tuple[str, str]]:
    if not (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Attribute) and decorator.args
            and isinstance(decorator.args[0], ast.Constant) and isinstance(decorator.args[0].value, str)):
        return []
    kind, path = decorator.func.attr, decorator.args[0].value
    if kind in HTTP_METHODS:
        return [(kind.upper(), path)]
    if kind == "api_route":
        methods = next((kw.value for kw in decorator.keywords if kw.arg == "methods"), None)
        if isinstance(methods, (ast.List, ast.Tuple)):
            return [(m.value.upper(), path) for m in methods.elts if isinstance(m, ast.Constant)]
        return [("GET", path)]  # FastAPI's default
    return []


def request_classes(source: str) -> dict[str, dict]:
    """Every class with annotated fields: {name: {"bases": [...], "fields": {field: {"type", "default"}}}}
    (own fields only; `fields_of` follows the bases)."""
    out = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields = {}
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                if item.annotation is not None and ast.unparse(item.annotation).startswith("ClassVar"):
                    continue
                fields[item.target.id] = {"type": ast.unparse(item.annotation),
                                          "default": None if item.value is None else ast.unparse(item.value)}
        out[node.name] = {"bases": [ast.unparse(b) for b in node.bases], "fields": fields}
    return out


def fields_of(classes: dict[str, dict], name: str) -> dict[str, dict]:
    """A class's fields with its bases' (those defined in the same module), bases first, as Python orders them."""
    cls = classes.get(name)
    if cls is None:
        return {}
    merged: dict[str, dict] = {}
    for base in cls["bases"]:
        merged.update(fields_of(classes, base))
    merged.update(cls["fields"])
    return merged


def init_params(source: str, class_name: str) -> dict[str, str | None]:
    """`class_name.__init__`'s keyword parameters and their defaults (unparsed)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    args = item.args.args[1:]
                    defaults = [None] * (len(args) - len(item.args.defaults)) + list(item.args.defaults)
                    out = {a.arg: (None if d is None else ast.unparse(d)) for a, d in zip(args, defaults)}
                    for a, d in zip(item.args.kwonlyargs, item.args.kw_defaults):
                        out[a.arg] = None if d is None else ast.unparse(d)
                    return out
    return {}


def sampling_keys(source: str) -> dict[str, str | None]:
    """SamplingParams' keys and defaults: its annotated fields (a msgspec Struct, 0.5.21+), else its
    __init__'s parameters (a plain class before)."""
    fields = fields_of(request_classes(source), "SamplingParams")
    return {k: v["default"] for k, v in fields.items()} if fields else init_params(source, "SamplingParams")


def refusals(source: str) -> list[dict]:
    """What the code answers instead of doing the work: [{"function", "kind", "text"}], in source order.
    kind: "reply" (a call with success=False and a message), "raise" (an exception with a message), "assert"."""
    out = []
    for func in ast.walk(ast.parse(source)):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in sorted(_own_nodes(func), key=lambda n: (getattr(n, "lineno", 0), getattr(n, "col_offset", 0))):
            if isinstance(node, ast.Call):
                kw = {k.arg: k.value for k in node.keywords}
                if isinstance(kw.get("success"), ast.Constant) and kw["success"].value is False and "message" in kw:
                    out.append({"function": func.name, "kind": "reply", "text": _text(kw["message"])})
            elif isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
                out.append({"function": func.name, "kind": "raise",
                            "text": f"{ast.unparse(node.exc.func)}: {_text(node.exc.args[0])}"})
            elif isinstance(node, ast.Assert) and node.msg is not None:
                out.append({"function": func.name, "kind": "assert", "text": _text(node.msg)})
    return out


def _own_nodes(func: ast.AST):
    """The nodes of a function, not of the functions nested in it (they are visited on their own)."""
    stack = list(ast.iter_child_nodes(func))
    while stack:
        node = stack.pop(0)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def _text(node: ast.expr) -> str:
    """A message as written: string pieces joined, f-string holes as {expr}."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{" + ast.unparse(v.value) + "}"
                       for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _text(node.left) + _text(node.right)
    return ast.unparse(node)


def audit_sources(files: dict[str, str]) -> dict:
    """One release's facts from its source files (path -> text; missing files are skipped)."""
    found_routes = routes(files.get(HTTP_SERVER, ""))
    classes = request_classes(files.get(IO_STRUCT, ""))
    requests = {}
    for route in found_routes:
        for name in route["params"]:
            if name in classes and name not in requests:
                requests[name] = fields_of(classes, name)
        route["request"] = next((n for n in route["params"] if n in classes), None)
        route["proxy"] = route["path"] in PROXY_ROUTES
        del route["params"]
    return {
        "routes": found_routes,
        "requests": requests,
        "sampling_params": sampling_keys(files.get(SAMPLING, "")),
        "wire_sampling_params": sampling_keys(files.get(API_TYPES, "")),
        "refusals": {path: refusals(files[path]) for path in REFUSAL_FILES if path in files},
    }


# --- diffs (pure) ----------------------------------------------------------------------------------------

def diff(before: dict, after: dict) -> dict:
    """What changed from one release to the next, in the shapes the markdown prints."""
    def keys(rs):
        return {(r["method"], r["path"]): r for r in rs}

    old_routes, new_routes = keys(before["routes"]), keys(after["routes"])
    changed_requests = {}
    for name in sorted(set(before["requests"]) | set(after["requests"])):
        old, new = before["requests"].get(name, {}), after["requests"].get(name, {})
        change = {
            "added": {f: new[f] for f in new if f not in old},
            "removed": sorted(f for f in old if f not in new),
            "changed": {f: {"before": old[f], "after": new[f]} for f in new if f in old and old[f] != new[f]},
        }
        if name not in before["requests"] or name not in after["requests"]:
            continue  # a class first or last used by a route: the route's own diff says so
        if any(change.values()):
            changed_requests[name] = change
    old_sp, new_sp = before["sampling_params"], after["sampling_params"]
    old_wire, new_wire = before["wire_sampling_params"], after["wire_sampling_params"]
    old_ref = {(f, r["kind"], r["text"]) for f, rs in before["refusals"].items() for r in rs}
    new_ref = {(f, r["kind"], r["text"]) for f, rs in after["refusals"].items() for r in rs}
    return {
        "routes_added": [new_routes[k] for k in sorted(set(new_routes) - set(old_routes), key=lambda k: k[::-1])],
        "routes_removed": [old_routes[k] for k in sorted(set(old_routes) - set(new_routes), key=lambda k: k[::-1])],
        "requests_changed": changed_requests,
        "sampling_params_added": {k: new_sp[k] for k in new_sp if k not in old_sp},
        "sampling_params_removed": sorted(k for k in old_sp if k not in new_sp),
        "wire_sampling_params_added": sorted(k for k in new_wire if k not in old_wire),
        "wire_sampling_params_removed": sorted(k for k in old_wire if k not in new_wire),
        "refusals_added": [{"file": f, "kind": k, "text": t} for f, k, t in sorted(new_ref - old_ref)],
        "refusals_removed": [{"file": f, "kind": k, "text": t} for f, k, t in sorted(old_ref - new_ref)],
    }


# --- wheels ----------------------------------------------------------------------------------------------

def _key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version))


def releases(oldest: str = OLDEST) -> list[str]:
    """Final releases on the index from `oldest` on (`pip index versions sglang`), oldest first."""
    run = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "sglang"], capture_output=True,
                         text=True, check=True)
    line = next(line for line in run.stdout.splitlines() if line.startswith("Available versions:"))
    found = [v.strip() for v in line.split(":", 1)[1].split(",")]
    return sorted((v for v in found if _RELEASE.match(v) and _key(v) >= _key(oldest)), key=_key)


def wheel(version: str, cache: Path, offline: bool) -> Path:
    found = sorted(cache.glob(f"sglang-{version}-*.whl"))
    if not found and not offline:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", f"sglang=={version}",
                        "-d", str(cache)], check=True)
        found = sorted(cache.glob(f"sglang-{version}-*.whl"))
    if not found:
        raise SystemExit(f"no sglang {version} wheel in {cache} (run without --offline to download it)")
    return found[0]


def read_wheel(path: Path) -> dict[str, str]:
    wanted = {HTTP_SERVER, IO_STRUCT, SAMPLING, API_TYPES, *REFUSAL_FILES}
    with zipfile.ZipFile(path) as archive:
        return {name: archive.read(name).decode() for name in archive.namelist() if name in wanted}


# --- output ----------------------------------------------------------------------------------------------

def markdown(audits: dict[str, dict], diffs: dict[str, dict]) -> str:
    versions = list(audits)
    lines = [
        "# SGLang releases, read from their wheels",
        "",
        (f"Written by `bench/sglang_audit.py` (do not edit by hand; run it again when a release appears). "
        f"Releases {versions[0]} to {versions[-1]}; the facts per release are in `bench/sglang_versions.json`."),
        "Routes marked **proxy** are ones the proxy calls, or its clients call through it.",
        "",
        "## Summary",
        "",
        ("| release | routes | routes added | routes removed | request classes changed | SamplingParams keys "
        "added / removed | wire-contract sampling keys added / removed | refusals added / removed |"),
        "|---|---|---|---|---|---|---|---|",
        f"| {versions[0]} | {len(audits[versions[0]]['routes'])} | | | | | | |",
    ]
    for version, change in diffs.items():
        lines.append(
            f"| {version} | {len(audits[version]['routes'])} | {_route_list(change['routes_added'])} | "
            f"{_route_list(change['routes_removed'])} | {', '.join(change['requests_changed']) or '–'} | "
            f"{', '.join(change['sampling_params_added']) or '–'} / "
            f"{', '.join(change['sampling_params_removed']) or '–'} | "
            f"{_keys(change['wire_sampling_params_added'])} / {_keys(change['wire_sampling_params_removed'])} | "
            f"{len(change['refusals_added'])} / {len(change['refusals_removed'])} |")
    for version, change in diffs.items():
        previous = versions[versions.index(version) - 1]
        lines += ["", f"## {previous} → {version}", ""]
        for title, key in (("Routes added", "routes_added"), ("Routes removed", "routes_removed")):
            if change[key]:
                lines.append(f"**{title}:** " + ", ".join(
                    f"`{r['method']} {r['path']}`" + (" (**proxy**)" if r["proxy"] else "")
                    + (f" ({r['request']})" if r["request"] else "") for r in change[key]))
                lines.append("")
        for name, fields in change["requests_changed"].items():
            parts = [f"+`{f}: {v['type']} = {v['default']}`" for f, v in fields["added"].items()]
            parts += [f"−`{f}`" for f in fields["removed"]]
            parts += [f"~`{f}`: `{v['before']['type']} = {v['before']['default']}` → "
                      f"`{v['after']['type']} = {v['after']['default']}`" for f, v in fields["changed"].items()]
            lines.append(f"- `{name}`{_used_by(audits[version], name)}: " + "; ".join(parts))
        if change["sampling_params_added"] or change["sampling_params_removed"]:
            lines.append("- `SamplingParams` (`sampling_params` keys): " + "; ".join(
                [f"+`{k}={v}`" for k, v in change["sampling_params_added"].items()]
                + [f"−`{k}`" for k in change["sampling_params_removed"]]))
        for title, key in (("Refusals added", "refusals_added"), ("Refusals removed", "refusals_removed")):
            if change[key]:
                lines += ["", f"<details><summary>{title} ({len(change[key])})</summary>", ""]
                lines += [f"- `{'/'.join(Path(r['file']).parts[-2:])}` {r['kind']}: {_quote(r['text'])}"
                          for r in change[key]]
                lines += ["", "</details>"]
        if not any(change.values()):
            lines.append("Nothing the audit reads changed.")
    return "\n".join(lines) + "\n"


def _keys(keys: list[str]) -> str:
    return (", ".join(keys) if len(keys) <= 6 else f"{len(keys)} keys (the contract appears)") if keys else "–"


def _route_list(items: list[dict]) -> str:
    return ", ".join(f"`{r['method']} {r['path']}`" for r in items) or "–"


def _used_by(audit: dict, name: str) -> str:
    paths = sorted({r["path"] for r in audit["routes"] if r["request"] == name})
    proxy = any(r["request"] == name and r["proxy"] for r in audit["routes"])
    return f" ({', '.join(paths)}{'; **proxy**' if proxy else ''})" if paths else ""


def _quote(text: str) -> str:
    flat = " ".join(text.split()).replace("|", "\\|").replace("`", "'")
    return f"“{flat[:300]}{'…' if len(flat) > 300 else ''}”"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "sglang-audit")
    parser.add_argument("--oldest", default=OLDEST)
    parser.add_argument("--versions", nargs="*", help="these releases instead of asking the index")
    parser.add_argument("--offline", action="store_true", help="only the wheels already in --cache")
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args(argv)
    args.cache.mkdir(parents=True, exist_ok=True)
    if args.versions:
        versions = sorted(args.versions, key=_key)
    elif args.offline:
        versions = sorted({p.name.split("-")[1] for p in args.cache.glob("sglang-*.whl")
                           if _key(p.name.split("-")[1]) >= _key(args.oldest)}, key=_key)
    else:
        versions = releases(args.oldest)
    audits = {}
    for version in versions:
        path = wheel(version, args.cache, args.offline)
        audits[version] = {"wheel": path.name, **audit_sources(read_wheel(path))}
        print(f"{version}: {len(audits[version]['routes'])} routes, {len(audits[version]['requests'])} request "
              f"classes, {sum(map(len, audits[version]['refusals'].values()))} refusals", file=sys.stderr)
    diffs = {b: diff(audits[a], audits[b]) for a, b in itertools.pairwise(versions)}
    (args.out / "sglang_versions.json").write_text(json.dumps({"releases": audits, "diffs": diffs}, indent=1) + "\n")
    (args.out / "SGLANG_VERSIONS.md").write_text(markdown(audits, diffs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
