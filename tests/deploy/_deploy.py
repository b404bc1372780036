"""Helpers for the deploy tests: load deploy/ files, render kustomize overlays, pull commands
out of Dockerfiles / compose / Ray / k8s, and check them against the real CLI parsers."""

from __future__ import annotations

import argparse
import copy
import functools
import importlib.util
import json
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
OVERLAYS = sorted(p.parent for p in (K8S / "overlays").glob("*/kustomization.yaml"))
SHELL_SEPARATORS = {"&&", "||", ";", "|", "&"}


def load_yaml_docs(path: Path) -> list[Any]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


# ---- Dockerfiles ----------------------------------------------------------------------------
def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) pairs; comments dropped, backslash continuations joined."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def exec_form(rest: str) -> list[str]:
    """The JSON array of an exec-form ENTRYPOINT/CMD/HEALTHCHECK CMD (ValueError otherwise)."""
    value = json.loads(rest)
    if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise ValueError(f"not a JSON array of strings: {rest}")
    return value


def dockerfile_argv(path: Path) -> list[str]:
    """ENTRYPOINT + CMD of the final stage."""
    entry: list[str] = []
    cmd: list[str] = []
    for word, rest in dockerfile_instructions(path):
        if word == "FROM":
            entry, cmd = [], []
        elif word == "ENTRYPOINT":
            entry = exec_form(rest)
        elif word == "CMD":
            cmd = exec_form(rest)
    return entry + cmd


def dockerfile_healthcheck(path: Path) -> list[str] | None:
    for word, rest in dockerfile_instructions(path):
        if word == "HEALTHCHECK":
            return exec_form(rest[rest.index("CMD ") + 4 :])
    return None


# ---- kustomize (resources + images + JSON6902 patches: the subset deploy/ uses) ---------------
def render_kustomization(directory: Path) -> list[dict[str, Any]]:
    kust = yaml.safe_load((directory / "kustomization.yaml").read_text())
    docs: list[dict[str, Any]] = []
    for res in kust.get("resources", []):
        target = (directory / res).resolve()
        if target.is_dir():
            docs += render_kustomization(target)
        elif target.is_file():
            docs += load_yaml_docs(target)
        else:
            raise FileNotFoundError(f"{directory}/kustomization.yaml: resource {res} missing")
    for patch in kust.get("patches", []):
        ops = yaml.safe_load((directory / patch["path"]).read_text())
        if isinstance(ops, dict):  # a strategic-merge patch: deployed only as `$patch: delete`
            docs = _delete(docs, ops, f"{directory}: patch {patch['path']}")
            continue
        sel = patch["target"]
        matches = [
            d
            for d in docs
            if d["kind"] == sel["kind"]
            and d["metadata"]["name"] == sel["name"]
            and d["apiVersion"].split("/")[-1] == sel["version"]
        ]
        if len(matches) != 1:
            raise LookupError(f"{directory}: patch {patch['path']} matches {len(matches)} objects")
        for op in ops:
            apply_json_patch(matches[0], op)
    for image in kust.get("images", []):
        for c in iter_containers(docs):
            name, _, tag = c["image"].partition(":")
            if name == image["name"]:
                c["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"
    return docs


def _delete(docs: list[dict[str, Any]], patch: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """`docs` without the one object a `$patch: delete` patch names (LookupError unless exactly
    one matches; ValueError for any other strategic-merge patch, which deploy/ does not use)."""
    if patch.get("$patch") != "delete":
        raise ValueError(f"{where}: only `$patch: delete` strategic-merge patches are rendered")
    key = (patch["apiVersion"], patch["kind"], patch["metadata"]["name"])
    kept = [d for d in docs if (d["apiVersion"], d["kind"], d["metadata"]["name"]) != key]
    if len(kept) != len(docs) - 1:
        raise LookupError(f"{where}: deletes {len(docs) - len(kept)} objects, not one")
    return kept


def apply_json_patch(doc: dict[str, Any], op: dict[str, Any]) -> None:
    """RFC 6902 add/remove/replace (mutates `doc`); KeyError/IndexError if the path is absent."""
    parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
    parent: Any = doc
    for p in parts[:-1]:
        parent = parent[int(p)] if isinstance(parent, list) else parent[p]
    last = parts[-1]
    value = copy.deepcopy(op.get("value"))
    if isinstance(parent, list):
        if op["op"] == "add":
            parent.insert(len(parent) if last == "-" else int(last), value)
        elif op["op"] == "remove":
            del parent[int(last)]
        else:
            parent[int(last)]  # must exist
            parent[int(last)] = value
    else:
        if op["op"] in ("remove", "replace") and last not in parent:
            raise KeyError(f"{op['path']}: no such member to {op['op']}")
        if op["op"] == "remove":
            del parent[last]
        else:
            parent[last] = value


def pod_specs(docs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for d in docs:
        if d["kind"] == "Deployment":
            yield d["metadata"]["name"], d["spec"]["template"]["spec"]
        elif d["kind"] == "RayCluster":
            yield "ray-head", d["spec"]["headGroupSpec"]["template"]["spec"]
            for g in d["spec"]["workerGroupSpecs"]:
                yield f"ray-{g['groupName']}", g["template"]["spec"]


def iter_containers(docs: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for _, spec in pod_specs(docs):
        yield from spec.get("initContainers", [])
        yield from spec["containers"]


# ---- commands -------------------------------------------------------------------------------
def split_shell(script: str) -> list[list[str]]:
    """Simple commands of a shell string (no subshells in deploy/), env assignments and
    `exec`/`nohup` dropped, redirections dropped."""
    lexer = shlex.shlex(script, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    cmds: list[list[str]] = [[]]
    for tok in lexer:
        if tok in SHELL_SEPARATORS:
            cmds.append([])
        else:
            cmds[-1].append(tok)
    out = []
    for cmd in cmds:
        while cmd and (
            ("=" in cmd[0] and not cmd[0].startswith("-")) or cmd[0] in ("exec", "nohup")
        ):
            cmd = cmd[1:]
        cleaned: list[str] = []
        skip = False
        for tok in cmd:
            if skip:
                skip = False
            elif tok in (">", ">>", "<", "2>", "2>&1") or tok.startswith(("2>", ">")):
                skip = tok in (">", ">>", "<", "2>")
            else:
                cleaned.append(tok)
        if cleaned:
            out.append(cleaned)
    return out


def container_argvs(container: dict[str, Any]) -> list[list[str]]:
    """Every command a container (or probe) runs: exec form, or each command of a `sh -c`."""
    argv = list(container.get("command", [])) + list(container.get("args", []))
    if argv[:1] in (["/bin/bash"], ["bash"], ["/bin/sh"], ["sh"]):
        script = [a for a in argv[1:] if not a.startswith("-")]
        return [c for s in script for c in split_shell(s)]
    return [argv] if argv else []


def probe_argvs(container: dict[str, Any]) -> list[list[str]]:
    out = []
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container.get(kind)
        if probe and "exec" in probe:
            out.append(probe["exec"]["command"])
    return out


# ---- the real parsers -----------------------------------------------------------------------
@functools.cache
def compactor_parser() -> argparse.ArgumentParser:
    from compactor.cli import build_parser

    return build_parser()


@functools.cache
def sglang_parser() -> argparse.ArgumentParser:
    from sglang.srt.server_args import ServerArgs

    import sglang_ext.config

    parser = argparse.ArgumentParser(prog="sglang.launch_server")
    ServerArgs.add_cli_args(parser)
    sglang_ext.config.add_cli_args(parser)
    return parser


@functools.cache
def script_parser(relpath: str) -> argparse.ArgumentParser:
    """`build_parser()` of a deploy/ script (healthcheck.py, wait_for_gpus.py)."""
    spec = importlib.util.spec_from_file_location(Path(relpath).stem, DEPLOY / relpath)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_parser()


@functools.cache
def ray_start_options() -> frozenset[str]:
    from ray.scripts.scripts import start

    return frozenset(o for p in start.params for o in p.opts if o.startswith("--"))


@functools.cache
def router_parser() -> argparse.ArgumentParser | None:
    """sglang-router's own `launch_router` parser (`RouterArgs.add_cli_args`, no prefix), from
    the installed package or `make pd-deps`'s copy (harness.pd.PD_DEPS/router); None when
    neither is there."""
    import sys

    from harness.pd import PD_DEPS

    try:
        from sglang_router.router_args import RouterArgs
    except ImportError:
        if not (PD_DEPS / "router" / "sglang_router").is_dir():
            return None
        sys.path.append(str(PD_DEPS / "router"))
        from sglang_router.router_args import RouterArgs
    parser = argparse.ArgumentParser(prog="sglang_router.launch_router")
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    return parser


SCRIPTS = {
    "/opt/compactor/healthcheck.py": "docker/healthcheck.py",
    "/opt/compactor/wait_for_gpus.py": "ray/wait_for_gpus.py",
}


def classify(argv: list[str]) -> tuple[str, list[str]] | None:
    """(program, its arguments) for the commands deploy/ runs that have a parser here."""
    if argv[:2] == ["compactor", "serve"]:
        return "compactor", argv[1:]
    if argv[:3] in (
        ["python", "-m", "sglang.launch_server"],
        ["python3", "-m", "sglang.launch_server"],
    ):
        return "sglang", argv[3:]
    if argv[:3] in (
        ["python", "-m", "sglang_router.launch_router"],
        ["python3", "-m", "sglang_router.launch_router"],
    ):
        return "sglang-router", argv[3:]
    if argv[:1] in (["python"], ["python3"]) and len(argv) > 1 and argv[1] in SCRIPTS:
        return SCRIPTS[argv[1]], argv[2:]
    if argv[:2] == ["ray", "start"]:
        return "ray-start", argv[2:]
    return None


def check_argv(program: str, args: list[str]) -> argparse.Namespace | None:
    """Parse `args` with the real parser of `program`; AssertionError naming the bad flag.

    Every `--flag` must be spelled exactly (argparse would accept abbreviations)."""
    if program == "ray-start":
        opts = ray_start_options()
        for a in args:
            if a.startswith("--"):
                flag = a.split("=", 1)[0]
                assert flag in opts, f"ray start has no option {flag}"
        return None
    parser_obj: argparse.ArgumentParser | None
    if program == "sglang-router":
        parser_obj = router_parser()
        if parser_obj is None:
            pytest.skip("sglang-router is not installed: run `make pd-deps`")
    else:
        parser = {"compactor": compactor_parser, "sglang": sglang_parser}.get(program)
        parser_obj = parser() if parser else script_parser(program)
    known = set(_option_strings(parser_obj))
    for a in args:
        if a.startswith("--"):
            flag = a.split("=", 1)[0]
            assert flag in known, f"{program}: unknown flag {flag}"
    try:
        return parser_obj.parse_args(args)
    except SystemExit as exc:
        raise AssertionError(f"{program}: argparse rejected {args}") from exc


def _option_strings(parser: argparse.ArgumentParser) -> Iterator[str]:
    for action in parser._actions:
        yield from action.option_strings
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _option_strings(sub)


# ---- what the rendered objects are ------------------------------------------------------------
def sglang_servers(docs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(Deployment, container) for each container that runs `python -m sglang.launch_server`."""
    out = []
    for d in docs:
        if d["kind"] != "Deployment":
            continue
        for c in d["spec"]["template"]["spec"]["containers"]:
            if any((k := classify(a)) and k[0] == "sglang" for a in container_argvs(c)):
                out.append((d, c))
    return out


def compaction_clients(docs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The SGLang servers that dial the compaction service (`--compaction-endpoint`)."""
    return [
        (d, c)
        for d, c in sglang_servers(docs)
        if any("--compaction-endpoint" in a for a in container_argvs(c))
    ]


def ingress_allowed(
    docs: list[dict[str, Any]], src: dict[str, str], dst: dict[str, str], port: int,
    src_namespace: dict[str, str] | None = None,
) -> bool:  # fmt: skip
    """Whether the NetworkPolicies in `docs` let a pod labelled `src` (in the manifests' own
    namespace, or one labelled `src_namespace`) open TCP `port` on a pod labelled `dst`: a pod
    no policy selects takes everything; else some rule of a selecting policy must admit it.
    Only the subset deploy/ writes: matchLabels, ingress, TCP ports by number."""
    mine = [
        p
        for p in docs
        if p["kind"] == "NetworkPolicy"
        and p["spec"]["podSelector"].get("matchLabels", {}).items() <= dst.items()
    ]
    if not mine:
        return True
    for rule in (r for p in mine for r in p["spec"].get("ingress", [])):
        if rule.get("ports") and port not in {q["port"] for q in rule["ports"]}:  # [] = all
            continue
        if "from" not in rule:  # every source
            return True
        for peer in rule["from"]:
            ns_sel = peer.get("namespaceSelector")
            if ns_sel is None:
                ns_ok = src_namespace is None
            else:
                ns_ok = src_namespace is not None and (
                    ns_sel.get("matchLabels", {}).items() <= src_namespace.items()
                )
            pod_sel = peer.get("podSelector", {}).get("matchLabels", {})
            if ns_ok and pod_sel.items() <= src.items():
                return True
    return False
