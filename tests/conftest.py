"""Shared fixtures: tiny offline checkpoints of every model family, built once per test session, mmserve's CPU
kernels, and the servers that several end-to-end modules share."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from mmserve.engine.cpu_kernels import CpuKernels, load_cpu_kernels
from mmserve.testing.probes import settled_integrity
from mmserve.testing.process_group import SharedProcess
from mmserve.testing.server_process import ServerHandle, start_server
from mmserve.testing.tiny_models import KIT, build_tiny_model
from mmserve.transport.cluster_auth import ENV_VAR

ARCHS = tuple(KIT)  # every family in mmserve.models.family.FAMILIES


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """arch -> directory of its tiny checkpoint (built on first use, shared by the whole session)."""
    built: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in built:
            built[arch] = build_tiny_model(str(tmp_path_factory.mktemp(f"tiny_{arch}")), arch=arch)
        return built[arch]

    return get


@pytest.fixture(scope="session")
def references(tiny_model):
    """arch -> the HF reference (model and HF's own processor) of the family's tiny checkpoint, fp32, with the
    tests/families.py settings; built on first use and shared by the session's parity modules."""
    from mmserve.testing.reference import HFReference
    from tests.families import FAMILIES

    made = {}

    def get(arch: str) -> HFReference:
        if arch not in made:
            made[arch] = HFReference(tiny_model(arch), mm_processor_kwargs=FAMILIES[arch].mm_kwargs)
        return made[arch]

    return get


@pytest.fixture(scope="session")
def oracles(references):
    """arch -> its HF `generate` oracle: Case -> ReferenceOutput (greedy, MAX_NEW tokens)."""
    from tests.engine_helpers import reference
    from tests.test_engine_parity import MAX_NEW

    return lambda arch: lambda case: reference(references(arch), case, MAX_NEW)


@pytest.fixture(scope="session")
def kernels() -> CpuKernels:
    """mmserve's CPU kernels (the README's set-up builds them: a machine without them fails here, not skips)."""
    loaded = load_cpu_kernels()
    assert loaded is not None, "the CPU kernels did not build (see the warning logged above)"
    return loaded


@pytest.fixture(scope="session")
def tiny_qwen2_vl(tiny_model) -> str:
    return tiny_model("qwen2_vl")


@pytest.fixture(scope="session")
def tiny_qwen2_5_vl(tiny_model) -> str:
    return tiny_model("qwen2_5_vl")


@pytest.fixture(scope="session")
def tiny_qwen3_vl(tiny_model) -> str:
    return tiny_model("qwen3_vl")


@pytest.fixture(scope="session")
def tiny_llava_onevision(tiny_model) -> str:
    return tiny_model("llava_onevision")


@pytest.fixture(scope="session")
def tiny_qwen2_audio(tiny_model) -> str:
    return tiny_model("qwen2_audio")


@pytest.fixture(scope="session", params=["qwen2_vl", "qwen2_5_vl"])
def tiny_model_dir(request, tiny_model) -> str:
    return tiny_model(request.param)


def random_image(seed: int, width: int = 64, height: int = 48) -> Image.Image:
    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(height, width, 3) * 255).astype("uint8"))


# -- servers that several modules share -----------------------------------------------------------------
# A start and a stop of `mmserve serve` cost ~15 s of a two-core runner, mostly imports; a module whose tests
# need no flag of their own takes one of these instead of starting its own. Each starts on first use (its
# `SharedProcess.get()`, or `get_beside()` to start a module's own server side by side with it) and stops
# right after the last test that uses it, once its engine's integrity checks out. Whatever a user leaves
# behind outlives its module (caches, counters, the log, registered encoders): a user reads counters and the
# log as differences, sends images and prompts no other user sends where a cache hit would change what it
# checks, and undoes its registrations. Each server's flags are the union of what its users need; no flag
# changes anything another user checks.
PLAIN_ARGS = (
    # 32768 KV slots: test_openai_surface's n=16 x 3000 tokens must not fit (400), test_disconnect's 20 clients
    # asking for 3000 tokens each are admitted (and aborted long before they could fill it).
    *("--kv-cache-mb", "16"),
    "--enable-auto-tool-choice",  # test_openai_surface: tool_choice "auto"
    *("--log-level", "info", "--log-stats-interval", "0.5"),  # test_metrics_vllm reads the stats log
    *("--served-model-name", "tiny", "tiny-alias"),  # test_endpoints: an alias
)
API_KEY = "s3cret"  # the keyed server's --api-key
KEYED_ARGS = (  # test_server_e2e's limits, each tested there; test_endpoints needs only the key
    *("--kv-cache-mb", "16", "--api-key", API_KEY, "--max-request-body-mb", "0.05", "--max-num-seqs", "1"),
    *("--max-media-mb", "0.01", "--max-waiting-requests", "0", "--disable-prefix-cache"),
)
SECURED_EPD_ARGS = ("--kv-cache-mb", "16", "--encoder-workers", "2", "--language-only")
CLUSTER_SECRET = "shared test cluster secret, 16+ bytes"  # the secured EPD server's (MMSERVE_CLUSTER_SECRET)
LANGUAGE_ONLY_ARGS = ("--kv-cache-mb", "16", "--language-only", "--enable-anonymous-registration")
SHARED = (  # the session fixtures below, each a SharedProcess
    "shared_server_process",
    "shared_keyed_process",
    "shared_secured_epd_process",
    "shared_language_only_process",
)
_SHARED = pytest.StashKey[dict[str, SharedProcess]]()  # fixture name -> its shared process
_LAST_USE = pytest.StashKey[dict[str, list[str]]]()  # node id -> the shared fixtures it is the last user of


def _shared(request, name: str, shared: SharedProcess):
    request.config.stash.setdefault(_SHARED, {})[name] = shared
    yield shared
    assert shared.stop(_settled) in (None, 0)


def _settled(handle: ServerHandle) -> None:
    settled_integrity(handle.url)


@pytest.fixture(scope="session")
def shared_server_process(request, tiny_qwen2_vl, tmp_path_factory):
    """A plain tiny Qwen2-VL server (`PLAIN_ARGS`): test_cache_salt, test_disconnect, test_endpoints,
    test_metrics_vllm, test_openai_surface, test_precomputed_embeddings (flag off) and test_server_e2e."""
    logs = str(tmp_path_factory.mktemp("shared-plain"))
    start = SharedProcess(lambda: start_server(tiny_qwen2_vl, *PLAIN_ARGS, log_dir=logs))
    yield from _shared(request, "shared_server_process", start)


@pytest.fixture(scope="session")
def shared_server(shared_server_process) -> ServerHandle:
    return shared_server_process.get()


@pytest.fixture(scope="session")
def shared_keyed_process(request, tiny_qwen2_vl, tmp_path_factory):
    """A tiny Qwen2-VL server with an API key and tight limits (`KEYED_ARGS`): test_endpoints and
    test_server_e2e."""
    logs = str(tmp_path_factory.mktemp("shared-keyed"))
    start = SharedProcess(lambda: start_server(tiny_qwen2_vl, *KEYED_ARGS, log_dir=logs))
    yield from _shared(request, "shared_keyed_process", start)


@pytest.fixture(scope="session")
def shared_secured_epd_process(request, tiny_qwen2_vl, tmp_path_factory):
    """A language-only EPD server with two encoder workers and `CLUSTER_SECRET`: test_bench_cli and
    test_cluster_auth."""
    logs = str(tmp_path_factory.mktemp("shared-secured-epd"))
    env = {ENV_VAR: CLUSTER_SECRET}
    start = SharedProcess(lambda: start_server(tiny_qwen2_vl, *SECURED_EPD_ARGS, log_dir=logs, env=env))
    yield from _shared(request, "shared_secured_epd_process", start)


@pytest.fixture(scope="session")
def shared_language_only_process(request, tiny_qwen2_vl, tmp_path_factory):
    """A language-only server with no encoder and the anonymous control plane: test_control_plane and
    test_epd_e2e. A user that registers an encoder unregisters it."""
    logs = str(tmp_path_factory.mktemp("shared-language-only"))
    start = SharedProcess(lambda: start_server(tiny_qwen2_vl, *LANGUAGE_ONLY_ARGS, log_dir=logs))
    yield from _shared(request, "shared_language_only_process", start)


def _shared_by(item) -> set[str]:
    return {name for name in SHARED if name in getattr(item, "fixturenames", ())}


@pytest.hookimpl(trylast=True)  # after deselection (-m, -k): the tests that will run
def pytest_collection_modifyitems(config, items):
    # Modules that share a server run one after another, where the first of them would run: a server idling
    # through the modules between its users would still cost ~2% of a core (and its memory).
    def module_of(item) -> str:
        return item.nodeid.split("::", 1)[0]

    uses: dict[str, set[str]] = {}  # module -> the shared fixtures its tests use (modules in run order)
    for item in items:
        uses.setdefault(module_of(item), set()).update(_shared_by(item))
    groups: list[tuple[set[str], list[str]]] = []  # (fixtures, modules): modules linked by what they share
    for module, names in uses.items():
        if names:
            linked = [g for g in groups if g[0] & names]
            merged = (names.union(*(g[0] for g in linked)), [m for g in linked for m in g[1]] + [module])
            groups = [g for g in groups if g not in linked] + [merged]
    order = list(uses)
    leader = {m: min(ms, key=order.index) for _, ms in groups for m in ms}
    placed: set[str] = set()
    ordered = []
    for item in items:
        module = module_of(item)
        if module not in leader:
            ordered.append(item)
        elif leader[module] not in placed:
            placed.add(leader[module])
            ordered += [i for i in items if leader.get(module_of(i)) == leader[module]]
    items[:] = ordered
    last: dict[str, str] = {}
    for item in items:
        for name in _shared_by(item):
            last[name] = item.nodeid
    by_node: dict[str, list[str]] = {}
    for name, nodeid in last.items():
        by_node.setdefault(nodeid, []).append(name)
    config.stash[_LAST_USE] = by_node


@pytest.fixture(autouse=True)
def _stop_shared_servers_after_their_last_user(request):
    yield
    shared = request.config.stash.get(_SHARED, {})
    for name in request.config.stash.get(_LAST_USE, {}).get(request.node.nodeid, ()):
        if name in shared:
            assert shared[name].stop(_settled) in (None, 0)
