"""``prepare``, ``verify`` and ``stats``: build, re-check and describe a corpus (nedolm.data)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click
import msgspec
import yaml

from nedolm.data.advice import build_warnings, drop_hint, stop_hint
from nedolm.data.atomic import atomic_write_bytes
from nedolm.data.build_options import DEFAULT_SHARDS, DEFAULT_VAL_FRACTION
from nedolm.data.builder import BuildError, BuildOptions, BuildReport, build_corpus
from nedolm.data.contract import DatasetContractError, audited_seq_len
from nedolm.data.drops import drop_warning
from nedolm.data.format import ShardFormatError
from nedolm.data.inputs import FORMATS
from nedolm.data.packing import discover_sft_shards
from nedolm.data.sources import MAX_LINE_BYTES, BadRecordError, InputError, RecordPolicy
from nedolm.data.stats import corpus_stats, packing_quality
from nedolm.data.summary import REPORTED, corpus_summary
from nedolm.data.tokenizer import TokenizerError
from nedolm.data.verify import check_corpus

_USER_ERRORS = (InputError, BuildError, TokenizerError, ShardFormatError)


class _BadRecordVerb(click.Choice):
    """error | drop; ``skip``, the verb of earlier versions, still means drop."""

    def convert(
        self, value: object, param: click.Parameter | None, ctx: click.Context | None
    ) -> str:
        return super().convert("drop" if value == "skip" else value, param, ctx)


def _role_map(pairs: tuple[str, ...]) -> dict[str, str]:
    mapping = {}
    for pair in pairs:
        source, sep, target = pair.partition("=")
        if not sep or not source or not target:
            raise click.BadParameter(f"{pair!r} is not FROM=TO", param_hint="--map-role")
        mapping[source] = target
    return mapping


def _shard_ids(text: str | None) -> tuple[int, ...]:
    if not text:
        return ()
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise click.BadParameter(
            f"{text!r} is not a comma-separated list of shard ids", param_hint="--val-shards"
        ) from None


def _weighted(pairs: tuple[str, ...], mix_file: Path | None) -> dict[Path, float]:
    """--mix FILE=WEIGHT pairs and a mixture YAML ({FILE: WEIGHT}, paths relative to it)."""
    mixture: dict[Path, float] = {}

    def add(path: Path, weight: object, where: str) -> None:
        if path in mixture:
            raise click.BadParameter(f"{path}: weighed twice", param_hint="--mix")
        mixture[path] = _weight(weight, where)

    for pair in pairs:
        path, sep, weight = pair.rpartition("=")
        if not sep or not path:
            raise click.BadParameter(f"{pair!r} is not FILE=WEIGHT", param_hint="--mix")
        add(Path(path), weight, f"--mix {pair}")
    if mix_file is not None:
        try:
            entries = yaml.safe_load(mix_file.read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError) as exc:
            raise click.BadParameter(f"{mix_file}: {exc}", param_hint="--mix-file") from None
        if not isinstance(entries, dict) or not entries:
            raise click.BadParameter(
                f"{mix_file}: not a mapping of input file to weight", param_hint="--mix-file"
            )
        for path, weight in entries.items():
            add(mix_file.parent / str(path), weight, f"{mix_file}: {path}")
    for path in mixture:
        if not path.exists():
            raise click.BadParameter(f"{path}: input file not found", param_hint="--mix")
    return mixture


def _weight(value: object, where: str) -> float:
    try:
        weight = float(str(value))
    except ValueError:
        weight = -1.0
    if not 0 < weight < float("inf"):
        raise click.BadParameter(
            f"{where}: the weight must be a positive number", param_hint="--mix"
        )
    return weight


@click.command()
@click.argument("inputs", nargs=-1, type=click.Path(exists=True, path_type=Path))
@click.option(
    "--format",
    "input_format",
    type=click.Choice(FORMATS),
    default="auto",
    show_default=True,
    help="How inputs are read. Three containers: jsonl (JSON lines or one JSON array, "
    "plain/.gz/.zst), parquet, datasets (a save_to_disk directory); in each the record schema "
    "(OpenAI messages, Alpaca, ShareGPT) is detected per record. sharegpt is not a container: "
    "jsonl with every record forced to ShareGPT. auto (default) detects the container per input.",
)
@click.option(
    "--messages-field",
    metavar="NAME",
    help="The key/column holding the turns (default: messages, then conversations).",
)
@click.option(
    "--tokenizer",
    required=True,
    type=click.Path(exists=True, path_type=Path),
    help="tokenizer.json (tokenizers) or SentencePiece .model (.gz works too), or a Hugging "
    "Face model directory holding tokenizer.json (+ tokenizer_config.json for EOS).",
)
@click.option(
    "--out",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="The DATA_DIR to create.",
)
@click.option(
    "--seq-len",
    required=True,
    type=click.IntRange(min=1),
    help="Training context; the packing audit is computed for it.",
)
@click.option(
    "--shards",
    type=click.IntRange(min=1),
    help=f"Number of shards; documents are dealt round-robin (default {DEFAULT_SHARDS},"
    " or one per document when fewer).",
)
@click.option(
    "--shard-tokens",
    type=click.IntRange(min=1),
    help="Instead of --shards: fill shards in order up to this many tokens.",
)
@click.option(
    "--val-shards", help="Comma-separated shard ids held out for validation, e.g. 7 or 6,7."
)
@click.option(
    "--val-fraction",
    type=click.FloatRange(0, 1, max_open=True),
    help="Instead of --val-shards: hold out the last ceil(F * shards) shards, at least one"
    f" (default {DEFAULT_VAL_FRACTION:g}: the last of {DEFAULT_SHARDS}); 0 holds out none.",
)
@click.option(
    "--val-input",
    "val_inputs",
    multiple=True,
    type=click.Path(exists=True, path_type=Path),
    metavar="FILE",
    help="Validate on FILE instead of shards held out of INPUTS (repeatable): each becomes"
    " one validation shard after the training shards, and training logs the validation loss"
    " of each FILE (val_loss_by_source) beside the overall one.",
)
@click.option(
    "--mix",
    multiple=True,
    metavar="FILE=WEIGHT",
    help="A mixture: FILE is an input whose share of the training conversations is"
    " WEIGHT / (sum of the weights) (repeatable; give every input this way, not as INPUTS)."
    " The corpus holds --mix-total conversations, by default as many as the inputs' usable"
    " ones together; each input's count is its share of that total rounded by largest"
    " remainder (floors first, the rest one each to the largest fractions, ties to the earlier"
    " input), so the counts sum to the total exactly. An input gives whole conversations:"
    " down-sampled without repeats, up-sampled by repeating each of them count // usable times"
    " and count % usable of them once more, drawn by --seed.",
)
@click.option(
    "--mix-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="A YAML mapping of input file (relative to the YAML file) to weight, read as --mix.",
)
@click.option(
    "--mix-total",
    type=click.IntRange(min=1),
    help="The mixture's training conversations (default: the weighted inputs' usable ones).",
)
@click.option(
    "--seed",
    type=int,
    default=0,
    show_default=True,
    help="Draws which conversations a mixture keeps or repeats.",
)
@click.option(
    "--max-drop-fraction",
    type=click.FloatRange(0, 1),
    metavar="F",
    help="Fail, writing no corpus, when more than F of the records or of the assistant"
    " tokens are dropped (prepare warns past 0.05 either way).",
)
@click.option(
    "--on-bad-record",
    type=_BadRecordVerb(["error", "drop"]),
    default="error",
    show_default=True,
    help="A record that cannot be used as it is (malformed JSON or UTF-8, wrong types, empty"
    " content, control or special tokens in the text, invalid tool calls or ShareGPT turns,"
    " roles outside system/user/assistant/tool, lines over --max-line-bytes): error stops at"
    " the first, naming file and record; drop drops it and counts it per reason. Records"
    " without targets or with a message longer than a window are always dropped and counted.",
)
@click.option(
    "--unsupported-roles",
    type=_BadRecordVerb(["error", "drop"]),
    help="Refines --on-bad-record for unsupported roles alone, e.g. --unsupported-roles drop"
    " drops the records with other roles but still stops on anything else.",
)
@click.option(
    "--map-role",
    multiple=True,
    metavar="FROM=TO",
    help="Rename a role before checking it, e.g. tool=user (repeatable); mapped messages are context only.",
)
@click.option(
    "--invalid-records",
    type=_BadRecordVerb(["error", "drop"]),
    hidden=True,  # the old name: --on-bad-record for every reason but roles
)
@click.option(
    "--train-tool-calls",
    is_flag=True,
    help="Make assistant messages with tool_calls targets (default: context only).",
)
@click.option(
    "--report",
    "report_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also write the build report (accounting, drop examples) as JSON to this file.",
)
@click.option(
    "--max-line-bytes",
    type=click.IntRange(min=1),
    default=MAX_LINE_BYTES,
    show_default=True,
    help="A longer input line (or JSON-array record) is a bad record (see --on-bad-record),"
    " skipped without reading it whole.",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Encoding processes; 1 encodes in-process (a tokenizer.json batch already uses every core).",
)
@click.option(
    "--unknown-tokens",
    type=click.Choice(["keep", "drop", "error"]),
    default="keep",
    show_default=True,
    help="Content with <unk> ids (characters outside the vocabulary): keep and count them"
    " (the report's unk column), drop the record, or stop.",
)
@click.option(
    "--dedup",
    is_flag=True,
    help="Drop a conversation identical to an earlier one (tokens and targets); always counted.",
)
@click.option("--overwrite", is_flag=True, help="Replace an --out that holds a different corpus.")
@click.option(
    "--progress/--no-progress",
    default=True,
    show_default=True,
    help="A progress bar over the bytes of input read (on stderr).",
)
def prepare(
    inputs: tuple[Path, ...],
    val_inputs: tuple[Path, ...],
    mix: tuple[str, ...],
    mix_file: Path | None,
    mix_total: int | None,
    seed: int,
    max_drop_fraction: float | None,
    input_format: str,
    messages_field: str | None,
    tokenizer: Path,
    out: Path,
    seq_len: int,
    shards: int | None,
    shard_tokens: int | None,
    val_shards: str | None,
    val_fraction: float | None,
    on_bad_record: str,
    unsupported_roles: str | None,
    map_role: tuple[str, ...],
    invalid_records: str | None,
    train_tool_calls: bool,
    report_path: Path | None,
    max_line_bytes: int,
    workers: int,
    unknown_tokens: str,
    dedup: bool,
    overwrite: bool,
    progress: bool,
) -> None:
    """Build a verified corpus DATA_DIR from chat INPUTS.

    INPUTS hold OpenAI-style {"messages": [...]}, ShareGPT {"conversations": [...]} or
    Alpaca-style instruction/input/output records: JSON lines or one JSON array [...] (plain,
    .gz, .zst), Parquet files or datasets save_to_disk directories. Records without a target
    or with a message too long for any window are dropped and counted; every input record is
    accounted for. By default 5% of the corpus (one shard of 20) is held out for validation;
    --val-input validates on files of their own instead. --mix weighs the inputs.

    \b
    Example:
      nedolm-sft prepare data/*.jsonl --tokenizer tokenizer.json --out corpus/ \\
          --seq-len 4096 --shards 8 --val-shards 7
      nedolm-sft prepare --mix data/a.jsonl=0.7 --mix data/b.jsonl=0.3 \\
          --val-input data/eval.jsonl --tokenizer tokenizer.json --out corpus/ --seq-len 4096
    """
    mixture = _weighted(mix, mix_file)
    if mixture and inputs:
        raise click.UsageError("give the inputs either as INPUTS or with --mix, not both")
    if not mixture and not inputs:
        raise click.UsageError("give the input files (INPUTS, or --mix FILE=WEIGHT)")
    try:
        options = BuildOptions(
            seq_len=seq_len,
            shards=shards,
            shard_tokens=shard_tokens,
            val_shards=_shard_ids(val_shards),
            val_fraction=val_fraction,
            policy=RecordPolicy(
                invalid_records=invalid_records or on_bad_record,
                unsupported_roles=unsupported_roles or on_bad_record,
                role_map=_role_map(map_role),
                train_tool_calls=train_tool_calls,
                unknown_tokens=unknown_tokens,
            ),
            input_format=input_format,
            messages_field=messages_field,
            workers=workers,
            max_line_bytes=max_line_bytes,
            overwrite=overwrite,
            dedup=dedup,
            weights=tuple(mixture.values()),
            mix_total=mix_total,
            seed=seed,
            max_drop_fraction=max_drop_fraction,
        )
        started = time.perf_counter()
        report = build_corpus(
            inputs or tuple(mixture),
            tokenizer,
            out,
            options,
            val_inputs=val_inputs,
            progress=progress,
        )
    except BadRecordError as exc:
        raise click.ClickException(f"{exc}; {stop_hint(exc.reason)}") from exc
    except (*_USER_ERRORS, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    if invalid_records is not None:
        click.echo("note: --invalid-records is the old name of --on-bad-record", err=True)
    _echo_report(report, seq_len, time.perf_counter() - started)
    if not report.validation_shard_ids and options.default_split:
        click.echo(
            "warning: no shard is held out for validation (the corpus has one shard);"
            " give --shards 2 or more, or --val-fraction 0 to mean none",
            err=True,
        )
    drops = drop_warning(report.drop_share, seq_len, report.drop_longest)
    for warning in ([drops] if drops else []) + build_warnings(report):
        click.echo(warning, err=True)
    if report_path is not None:
        atomic_write_bytes(report_path, msgspec.json.format(msgspec.json.encode(report)) + b"\n")


def _echo_report(report: BuildReport, seq_len: int, seconds: float) -> None:
    width = max(len(s.name) for s in report.sources)
    click.echo(
        f"{'input':<{width}}  {'records':>8}  {'kept':>8}  {'unk':>6}  {'lost':>6}  {'dups':>6}"
        "  dropped   (unk: <unk> ids in targets; lost: characters the tokenizer does not"
        " round-trip; dups: exact duplicate conversations)"
    )
    for s in report.sources:
        drops = ", ".join(f"{k} {v}" for k, v in s.dropped.items()) or "-"
        click.echo(
            f"{s.name:<{width}}  {s.records:>8}  {s.kept:>8}  {s.unk_target_tokens:>6}"
            f"  {s.lost_characters:>6}  {s.duplicate_conversations:>6}  {drops}"
        )
    kept = sum(s.kept for s in report.sources)
    left_out = sum(s.left_out for s in report.sources)
    dropped = report.dropped
    reasons = ", ".join(f"{k} {v}" for k, v in dropped.items())
    click.echo(
        f"records {report.records} = kept {kept}"
        + (f" + left out {left_out}" if left_out else "")
        + f" + dropped {sum(dropped.values())}"
        + (f" ({reasons})" if reasons else "")
    )
    _echo_mixture([msgspec.to_builtins(s) for s in report.sources])
    for reason, examples in report.drop_examples.items():
        hint = drop_hint(reason, seq_len, report.drop_longest.get(reason, 0))
        click.echo(f"dropped {reason} {dropped[reason]}: {hint}; e.g.:")
        for example in examples:
            click.echo(f"  {example}")
    state = "unchanged (identical rebuild)" if report.identical_rebuild else "written"
    click.echo(
        f"{report.out}: {state}; {report.shards} shards, validation {report.validation_shard_ids},"
        f" {report.documents} documents, {report.tokens} tokens; verify PASS ({seconds:.1f}s)"
    )


@click.command()
@click.argument("data_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
def verify(data_dir: Path) -> None:
    """Re-verify DATA_DIR: recompute every contract claim from the binaries.

    Exits non-zero and lists every problem (each naming the file) if anything differs.

    \b
    Example:
      nedolm-sft verify corpus/
    """
    started = time.perf_counter()
    problems = check_corpus(data_dir)
    if problems:
        for problem in problems:
            click.echo(f"FAIL {problem}", err=True)
        raise click.ClickException(
            f"{data_dir}: {len(problems)} problem(s); the corpus is not valid"
        )
    click.echo(f"{data_dir}: PASS ({time.perf_counter() - started:.1f}s)")


@click.command()
@click.argument("data_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option(
    "--seq-len",
    type=click.IntRange(min=1),
    help="Plan for this context (default: the audited one).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def stats(data_dir: Path, seq_len: int | None, as_json: bool) -> None:
    """Describe DATA_DIR: counts, role mix, lengths, drops, packing quality.

    \b
    Example:
      nedolm-sft stats corpus/ --seq-len 2048
    """
    try:
        built_seq_len = audited_seq_len(data_dir)
        seq_len = seq_len or built_seq_len
        planned = discover_sft_shards(data_dir, seq_len)
        result = {
            "corpus": corpus_summary(data_dir),
            "packing": corpus_stats(planned, seq_len),
            "packing_quality": packing_quality(planned, seq_len),
        }
    except (*_USER_ERRORS, DatasetContractError, OSError, KeyError, ValueError) as exc:
        raise click.ClickException(f"{data_dir}: {exc}") from exc
    if as_json:
        click.echo(json.dumps(result, indent=2, sort_keys=True, ensure_ascii=False))
        return
    _echo_stats(result, seq_len, built_seq_len)


def _echo_mixture(sources: list[dict]) -> None:
    """Per weighted or validation input: what the corpus holds of it and why."""
    for s in sources:  # the manifest leaves out counts at their default, 0
        repeated, left_out = s.get("repeated", 0), s.get("left_out", 0)
        if s.get("weight") is not None:
            click.echo(
                f"mixture {s['name']} (weight {s['weight']:g}): {s['kept'] + repeated}"
                f" conversations = kept {s['kept']} + repeated {repeated};"
                f" left out {left_out}, dropped {sum(s['dropped'].values())}"
                f" of {s['records']} records"
            )
        if s.get("validation_shard") is not None:
            click.echo(
                f"validation {s['name']}: shard {s['validation_shard']}, {s['kept']} conversations"
                f" (dropped {sum(s['dropped'].values())} of {s['records']} records)"
            )


def _echo_reported(corpus: dict) -> None:
    """The build's coverage and duplicate counts, in total and per source that has any."""
    for key, label in REPORTED.items():
        total = corpus["reported"][key]
        if total is None:
            click.echo(f"{label}: not recorded (corpus built before they were counted)")
            continue
        where = ", ".join(f"{s['name']} {s[key]}" for s in corpus["sources"] if s[key])
        click.echo(f"{label}: {total}" + (f" ({where})" if where else ""))


def _echo_stats(result: dict, seq_len: int, built_seq_len: int) -> None:
    """The summary lines; drop hints name ``built_seq_len``, the length the build dropped at."""
    corpus, packing, quality = result["corpus"], result["packing"], result["packing_quality"]
    roles = ", ".join(f"{k} {v}" for k, v in corpus["messages_by_role"].items())
    click.echo(
        f"documents {corpus['documents']}, messages {corpus['messages']} ({roles}), tokens {corpus['tokens_including_eos']}"
    )
    click.echo(
        f"assistant messages: trainable {corpus['assistant_trainable_messages']}, context only {corpus['assistant_context_messages']}"
    )
    if "dropped" in corpus:
        drops = ", ".join(f"{k} {v}" for k, v in corpus["dropped"].items()) or "none"
        click.echo(
            f"input records {corpus['input_records']}, dropped: {drops}; validation shards {corpus['validation_shard_ids']}"
        )
        for reason, count in corpus["dropped"].items():
            click.echo(f"dropped {reason} {count}: {drop_hint(reason, built_seq_len)}")
        _echo_mixture(corpus["sources"])
        _echo_reported(corpus)
    click.echo(
        "document tokens: "
        + "  ".join(f"{k} {v}" for k, v in corpus["document_tokens"]["histogram"].items())
    )
    for role, histogram in corpus["message_tokens_by_role"].items():
        click.echo(f"{role} message tokens: " + "  ".join(f"{k} {v}" for k, v in histogram.items()))
    click.echo(
        f"seq_len {seq_len}: windows {packing['windows']}, valid context {packing['valid_context_ratio']:.3f},"
        f" assistant targets {packing['assistant_target_tokens']} ({packing['assistant_target_ratio']:.3f}),"
        f" padded {packing['padded_tokens']}, continuations turn {packing['turn_aligned_continuations']}"
        f" / assistant {packing['assistant_aligned_continuations']} / hard {packing['hard_continuations']}"
    )
    for name in ("adaptive", "truncate", "concat_chunk"):
        q = quality[name]
        click.echo(
            f"  {name:<12} rows {q['rows']:>8}  valid context {q['valid_context_ratio']:.3f}"
            f"  padding {q['padding_ratio']:.3f}  targets lost {q['targets_lost']}"
            + (
                f"  targets attending across conversations {q['cross_document_targets']}"
                f"  conversations split {q['split_documents']}"
                if "cross_document_targets" in q
                else ""
            )
        )
