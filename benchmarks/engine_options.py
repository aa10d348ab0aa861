"""Engine options side by side: each drafter on an engine with its defaults and on one with the options given.

    python -m benchmarks.engine_options --option max_tree_nodes=16 --drafter prompt_lookup \
        --questions ../shared/data/mt_bench/question.jsonl --per-category 2 [decode.evaluate's other arguments]

One evaluation (decode.evaluate: warm-up, methods interleaved question by question, every greedy turn checked token
for token against plain decoding), in which each --drafter SPEC runs twice: as `speculative[SPEC]` on the engine's
defaults and as `speculative[SPEC@KEY=VALUE]` on an engine built with the options. --option KEY=VALUE (repeatable):
a keyword of decode.engine.SpeculativeEngine, VALUE in JSON (true, 3, "x"). Writes decode.evaluate's report under
--out, prints its tables, and exits 3 where a method's greedy output left plain decoding's, as decode.evaluate does.
"""

from __future__ import annotations

import inspect
import json
import logging
import sys

from benchmarks.harness import parser

OWN = {"target_model", "proposer", "eos_token_ids", "adaptive"}  # set by the evaluation itself (--fixed-depth)


def engine_options(pairs: list[str]) -> dict:
    """{keyword: value} from KEY=VALUE strings; a key SpeculativeEngine does not take, or a value that is not JSON,
    is a ValueError naming it."""
    from specdistill.decode.engine import SpeculativeEngine

    allowed = sorted(set(inspect.signature(SpeculativeEngine).parameters) - OWN)
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in allowed:
            raise ValueError(f"--option {pair!r}: expected KEY=VALUE with KEY one of {allowed}")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"--option {pair!r}: the value is not JSON ({err})") from None
    return options


def label(options: dict) -> str:
    """What the optioned twin's spec carries after '@': key=value pairs, values as JSON."""
    return ",".join(f"{key}={json.dumps(value)}" for key, value in options.items())


def main(argv=None) -> int:
    from specdistill.decode import evaluate
    from specdistill.models.drafters import load_drafter

    p = parser(__doc__, "engine_options", reps=1)
    p.add_argument("--option", action="append", required=True, metavar="KEY=VALUE",
                   help="a SpeculativeEngine keyword for the second engine of each drafter (repeatable)")
    args, rest = p.parse_known_args(argv)
    if args.reps != 1:
        p.error("--reps: one evaluation; run the command again for another")
    try:
        options = engine_options(args.option)
    except ValueError as err:
        p.error(str(err))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    eval_parser = evaluate.build_parser()
    config = evaluate.config_from_args(eval_parser.parse_args([*rest, "--warmup", str(args.warmup), "--out", args.out]))
    if not config.drafters:
        p.error("name at least one --drafter")
    questions, target, drafters = evaluate.load_inputs(eval_parser, config)
    twins = {f"{spec}@{label(options)}": load_drafter(spec, target, device=config.device) for spec in drafters}
    both = {**drafters, **twins}
    methods, skipped = evaluate.build_methods(target, both, config, engine_options={spec: options for spec in twins})
    result = evaluate.evaluate_methods(methods, skipped, target, both, questions, config)
    result.config["engine_options"] = options
    return evaluate.report_result(result, config)


if __name__ == "__main__":
    sys.exit(main())
