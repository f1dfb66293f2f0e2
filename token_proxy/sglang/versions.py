"""Which SGLang API generation the proxy talks to, and what differs between them (pure).

SGLang's `/server_info` reports its `version`. Every behaviour the proxy depends on that changed
between 0.5.17 (the release verified on a real server: /work/shared/golden, bench/RESULTS.md) and
0.5.23 (read from the released source only) is one flag here, derived from that version; see the
README's "SGLang versions" for the evidence. A version the proxy cannot parse (a source build
reports 0.0.0.dev0) or one newer than it knows gets the newest known generation; one older than
0.5.17 gets 0.5.17's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from token_proxy.sglang.sampling import keys_for

OLDEST_KNOWN = (0, 5, 17)
NEWEST_KNOWN = (0, 5, 23)
VERIFIED = (0, 5, 17)  # run against a real server; everything newer is read from source
KNOWN_RANGE = ("0.5.17", "0.5.23")

# sampling_params keys SGLang accepts (0.5.17: SamplingParams' API fields; 0.5.22+: the wire
# contract api/v1/api_types.py, which answers any other key with a 400): sglang/sampling.py.
SAMPLING_KEYS_0517 = frozenset(keys_for(OLDEST_KNOWN))

# Routes a release deleted that clients still call (bench/SGLANG_VERSIONS.md, from the wheels): the proxy
# answers them itself, in 0.5.17's shape, from what the running release offers (admin/removed_routes.py).
_REMOVED_ROUTES = (((0, 5, 21), ("/get_load", "/get_weight_version", "/weight_version",
                                 "/clear_hicache_storage_backend")),)

_VERSION = re.compile(r"^\s*v?(\d+)\.(\d+)\.(\d+)")


@dataclass(frozen=True, slots=True)
class SGLangFeatures:
    """What the proxy may rely on for one SGLang version (`version` as reported, `assumed` as used)."""

    version: str | None
    assumed: tuple[int, int, int]
    # /abort_request with an n > 1 request's rid stops its samples (0.5.17: child rids are
    # "<rid>_<uuid>"; from 0.5.18 they are bare uuids and the abort is a silent no-op).
    abort_reaches_n_samples: bool
    native_cache_salt: bool  # /generate's own `cache_salt` (0.5.18); before, only `extra_key`
    weight_version_spans: bool  # meta_info.weight_versions on a finished reply (0.5.19)
    has_ready: bool  # GET /ready (0.5.20)
    has_get_load: bool  # GET /get_load (gone in 0.5.21; /v1/loads serves every version)
    update_selector: bool  # update_weights_* take `selector`, not `disable_draft_model` (0.5.21)
    # /update_weights_from_distributed and _from_tensor answer success false unless a session is open:
    # POST /begin_weight_update ... POST /end_weight_update (0.5.21, PR #28001; _from_disk is not gated).
    weight_update_session: bool
    seed_range_checked: bool  # sampling_seed outside int64 is a 400 (0.5.21)
    strict_sampling_keys: bool  # an unknown sampling key is a 400, not a bare 500 (0.5.22)
    flush_refusal_is_reply: bool  # update + flush with requests pending: success false, no crash (0.5.22)
    sampling_keys: frozenset[str] = SAMPLING_KEYS_0517
    removed_routes: frozenset[str] = frozenset()  # deleted since 0.5.17 (the proxy answers them)

    @property
    def verified(self) -> bool:
        """Behaviour checked against a real server of this generation (not only read from source)."""
        return self.assumed == VERIFIED

    @property
    def exact(self) -> bool:
        """The reported version is one the proxy knows (not assumed from an unknown or unparseable one)."""
        return parse_version(self.version) == self.assumed

    @property
    def generation(self) -> str:
        return ".".join(map(str, self.assumed))

    def describe(self) -> str:
        reported = self.version or "no version"
        how = ("verified against a real 0.5.17 server" if self.verified
               else "behaviour read from SGLang's released source, not run")
        if not self.exact:
            return f"SGLang {reported}: treated as {self.generation} ({how})"
        return f"SGLang {reported} ({how})"


def parse_version(version) -> tuple[int, int, int] | None:
    """'0.5.23', '0.5.23.post1', '0.5.24rc1' -> (0, 5, x); None when not a release number."""
    match = _VERSION.match(version) if isinstance(version, str) else None
    if match is None:
        return None
    parsed = tuple(int(part) for part in match.groups())
    return None if parsed == (0, 0, 0) else parsed  # 0.0.0.dev0: a source build, version unknown


def features_for(version) -> SGLangFeatures:
    parsed = parse_version(version)
    assumed = NEWEST_KNOWN if parsed is None else min(max(parsed, OLDEST_KNOWN), NEWEST_KNOWN)

    def since(release: tuple[int, int, int]) -> bool:
        return assumed >= release

    return SGLangFeatures(
        version=version if isinstance(version, str) else None,
        assumed=assumed,
        abort_reaches_n_samples=not since((0, 5, 18)),
        native_cache_salt=since((0, 5, 18)),
        weight_version_spans=since((0, 5, 19)),
        has_ready=since((0, 5, 20)),
        has_get_load=not since((0, 5, 21)),
        update_selector=since((0, 5, 21)),
        weight_update_session=since((0, 5, 21)),
        seed_range_checked=since((0, 5, 21)),
        strict_sampling_keys=since((0, 5, 22)),
        flush_refusal_is_reply=since((0, 5, 22)),
        sampling_keys=frozenset(keys_for(assumed)),
        removed_routes=frozenset(path for release, paths in _REMOVED_ROUTES if since(release) for path in paths),
    )


VERIFIED_FEATURES = features_for("0.5.17")
