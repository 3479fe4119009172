"""How fast a `klm.LayoutMap` resolves layouts, and how that scales.

No model is built: synthetic weights are named the way a transformer's are,
an object path (`"block_12.attention.query.kernel"`) and a Keras 3
`variable.path` (`"model/block_12/attention/query/kernel"`), with shapes
(64, 64) for kernels and (64,) for vectors. A LayoutMap of 200 regex rules
resolves every weight with `layout_map.resolve(shape, object_path,
variable_path)`:

- 190 specific rules that match nothing (`block_{j}\\.mlp\\.w{k}.*`, k = 3..7),
- 6 specific rules that match a few weights (3 by object path, 3 by
  variable path),
- 4 broad rules at the end (`.*attention.*kernel`, `.*kernel`, `.*bias`,
  `.*gamma`), which place nearly every weight, so most lookups scan past all
  the specific rules first.

Times are the best of a few repeats, after one warm-up call that builds the
map's matcher (reported separately). For the smallest size every result is
checked against a naive first-rule-wins loop over `re.fullmatch`.

Goals: 10k weights in < 0.2 s; time grows linearly (10x weights -> ~10x time).

A second part times the broad case (issue 11): 10,000 rules that start with
`.*` (so no literal prefix narrows them down) that match nothing, then
`.*kernel` / `.*bias`. It prints, side by side, a plain first-match loop over
pre-compiled regexes and `LayoutMap.resolve`, per weight, for 40 weights and
for 4,000 (where the matcher has joined its blocks), the first lookup, and
`explain()` of a 40-weight model. Goal: never slower than the plain loop.

Run: KERAS_BACKEND=jax python benchmarks/rules.py
"""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import re  # noqa: E402
import time  # noqa: E402

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import keras_layoutmap as klm  # noqa: E402

SIZES = (1_000, 10_000, 100_000)
REPEATS = {1_000: 5, 10_000: 3, 100_000: 2}
GOAL_10K_S = 0.2
DIM = 64

# The weights of one synthetic block: (object-path suffix, shape).
KINDS = (
    ("attention.query.kernel", (DIM, DIM)),
    ("attention.key.kernel", (DIM, DIM)),
    ("attention.value.kernel", (DIM, DIM)),
    ("attention.output.kernel", (DIM, DIM)),
    ("attention.output.bias", (DIM,)),
    ("mlp.w1.kernel", (DIM, DIM)),
    ("mlp.w1.bias", (DIM,)),
    ("mlp.w2.kernel", (DIM, DIM)),
    ("mlp.w2.bias", (DIM,)),
    ("norm.gamma", (DIM,)),
)


def make_weights(n):
    """`n` synthetic weights as (shape, object_path, variable_path)."""
    weights = []
    for w in range(n):
        block = w // len(KINDS)
        suffix, shape = KINDS[w % len(KINDS)]
        object_path = f"block_{block}.{suffix}"
        variable_path = "model/" + object_path.replace(".", "/")
        weights.append((shape, object_path, variable_path))
    return weights


def make_layout_map():
    mesh = klm.create_mesh(
        [("batch", 4), ("model", 2)], devices=[f"cpu:{i}" for i in range(8)]
    )
    layout_map = klm.LayoutMap(mesh)
    # Specific rules that match no weight: there is no mlp.w3 .. mlp.w7.
    for j in range(38):
        for k in range(3, 8):
            layout_map[rf"block_{j}\.mlp\.w{k}.*"] = ("model", None)
    # Specific rules that win for a few weights.
    for j in (0, 7, 42):
        layout_map[rf"block_{j}\.mlp\.w1\.kernel"] = (None, "model")
        layout_map[rf"model/block_{j}/mlp/w2/kernel"] = ("model", None)
    # Broad rules: most weights fall through to these.
    layout_map[r".*attention.*kernel"] = (None, "model")
    layout_map[r".*kernel"] = ("model", None)
    layout_map[r".*bias"] = ("model",)
    layout_map[r".*gamma"] = (None,)
    return layout_map


def resolve_all(layout_map, weights):
    resolve = layout_map.resolve
    return [resolve(shape, op, vp)[0] for shape, op, vp in weights]


def naive_rule(rules, object_path, variable_path):
    for rule in rules:
        if re.fullmatch(rule, object_path) or re.fullmatch(rule, variable_path):
            return rule
    return None


def main():
    console = Console(width=120)
    layout_map = make_layout_map()
    rules = list(layout_map)
    console.print(f"LayoutMap: {len(rules)} rules on {layout_map.device_mesh!r}")

    start = time.perf_counter()
    layout_map.resolve((DIM, DIM), "warm.up.kernel", "warm/up/kernel")
    console.print(
        f"first resolve (builds the matcher): "
        f"{(time.perf_counter() - start) * 1e3:.2f} ms"
    )

    results = {}
    for n in SIZES:
        weights = make_weights(n)
        best, won = float("inf"), None
        for _ in range(REPEATS[n]):
            start = time.perf_counter()
            won = resolve_all(layout_map, weights)
            best = min(best, time.perf_counter() - start)
        results[n] = best
        if n == SIZES[0]:
            wrong = [
                (op, got)
                for (_, op, vp), got in zip(weights, won, strict=True)
                if got != naive_rule(rules, op, vp)
            ]
            status = "all agree" if not wrong else f"{len(wrong)} DIFFER: {wrong[:3]}"
            console.print(
                f"check against a naive first-match loop ({n} weights): {status}"
            )
            counts = {}
            for rule in won:
                counts[rule] = counts.get(rule, 0) + 1
            start = time.perf_counter()
            for _, op, vp in weights:
                naive_rule(rules, op, vp)
            naive = time.perf_counter() - start
            console.print(
                f"for scale: a naive loop of re.fullmatch over the rules takes "
                f"{naive:.4f} s for {n} weights ({naive / best:.1f}x resolve)"
            )
            console.print(
                "weights per winning rule: "
                + ", ".join(f"{rule}: {c}" for rule, c in counts.items())
            )

    table = Table(title=f"LayoutMap.resolve, {len(rules)} rules (best of repeats)")
    table.add_column("weights", justify="right")
    table.add_column("total (s)", justify="right")
    table.add_column("per weight (µs)", justify="right")
    table.add_column("growth vs previous size", justify="right")
    previous = None
    for n in SIZES:
        growth = "-" if previous is None else f"{results[n] / results[previous]:.2f}x"
        table.add_row(
            f"{n:,}", f"{results[n]:.4f}", f"{results[n] / n * 1e6:.2f}", growth
        )
        previous = n
    console.print(table)
    t10k = results[10_000]
    console.print(
        f"10k weights: {t10k:.4f} s (goal < {GOAL_10K_S} s: "
        f"{'meets' if t10k < GOAL_10K_S else 'misses'}); growth 10k/1k "
        f"{results[10_000] / results[1_000]:.2f}x, 100k/10k "
        f"{results[100_000] / results[10_000]:.2f}x (linear: 10x)"
    )


BROAD_RULES = 10_000


def make_broad_layout_map():
    mesh = klm.create_mesh(
        [("batch", 4), ("model", 2)], devices=[f"cpu:{i}" for i in range(8)]
    )
    layout_map = klm.LayoutMap(mesh)
    for j in range(BROAD_RULES):
        layout_map[rf".*block_{j}_unused\.w{j % 7}.*"] = ("model", None)
    layout_map[r".*kernel"] = (None, "model")
    layout_map[r".*bias"] = ("model",)
    return layout_map


def plain_loop(compiled, object_path, variable_path):
    for pattern in compiled:
        if pattern.fullmatch(object_path) or pattern.fullmatch(variable_path):
            return pattern.pattern
    return None


def _per_weight_ms(fn, weights, repeats=3):
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for shape, op, vp in weights:
            fn(shape, op, vp)
        best = min(best, time.perf_counter() - start)
    return best / len(weights) * 1e3


def broad_case(console):
    import keras

    layout_map = make_broad_layout_map()
    rules = list(layout_map)
    compiled = [re.compile(r) for r in rules]
    table = Table(title=f"{len(rules):,} rules, {BROAD_RULES:,} of them broad "
                  "(`.*...`): plain first-match loop vs LayoutMap")
    for col in ("case", "plain loop", "LayoutMap", "ratio"):
        table.add_column(col, justify="left" if col == "case" else "right")

    def row(case, loop, ours, unit):
        table.add_row(case, f"{loop:.2f} {unit}", f"{ours:.2f} {unit}",
                      f"{ours / loop:.2f}x")

    weights = make_weights(40)
    start = time.perf_counter()
    layout_map.resolve(*weights[0])
    first = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    plain_loop(compiled, *weights[0][1:])
    first_loop = (time.perf_counter() - start) * 1e3
    row("first lookup", first_loop, first, "ms")
    wrong = [w for w in weights
             if layout_map.resolve(*w)[0] != plain_loop(compiled, *w[1:])]
    loop = _per_weight_ms(lambda s, op, vp: plain_loop(compiled, op, vp), weights)
    ours = _per_weight_ms(layout_map.resolve, weights)
    row("per weight, 40 weights", loop, ours, "ms")
    many = make_weights(4_000)
    layout_map.resolve(*many[0])
    for w in many[:600]:  # past JOIN_AFTER: the blocks get joined
        layout_map.resolve(*w)
    loop = _per_weight_ms(
        lambda s, op, vp: plain_loop(compiled, op, vp), many[::10], repeats=1)
    ours = _per_weight_ms(layout_map.resolve, many, repeats=1)
    row("per weight, 4,000 weights", loop, ours, "ms")

    inputs = keras.Input((8,))
    x = inputs
    for i in range(20):
        x = keras.layers.Dense(8, name=f"block_{i}_dense")(x)
    model = keras.Model(inputs, x)
    fresh = make_broad_layout_map()
    start = time.perf_counter()
    report = fresh.explain(model)
    ours = time.perf_counter() - start
    start = time.perf_counter()
    for v in model.weights:  # what explain must know: winner, and every match
        op = v.path.split("/", 1)[1].replace("/", ".")
        plain_loop(compiled, op, v.path)
        [p for p in compiled if p.fullmatch(op) or p.fullmatch(v.path)]
    loop = time.perf_counter() - start
    row(f"explain(), {len(report.rows)} weights (s)", loop, ours, "s")
    console.print(table)
    console.print(
        "check against the plain loop (40 weights): "
        + ("all agree" if not wrong else f"{len(wrong)} DIFFER")
    )


if __name__ == "__main__":
    main()
    broad_case(Console(width=120))
