"""Matching many regex rules against weight paths, first rule wins, fast.

Used by `RuleMap` (`klm.LayoutMap`); `benchmarks/rules.py` measures it.
"""

import functools
import itertools
import re

try:  # the regex parser, to read a rule's literal prefix
    from re import _parser as _regex_parser
except ImportError:  # Python 3.10
    import sre_parse as _regex_parser


@functools.lru_cache(maxsize=1 << 16)
def literal_prefix(rule):
    """The literal text every key `rule` fullmatches must start with.

    `"block_3\\.mlp\\..*"` gives `"block_3.mlp."`; a rule that starts with
    anything but literal characters (or sets flags such as `(?i)`) gives "".
    """
    if rule[:1] in _NOT_LITERAL_START:
        return ""  # the common broad rule, `.*...`: no need to parse it
    try:
        parsed = _regex_parser.parse(rule)
    except Exception:
        return ""
    if parsed.state.flags & (re.IGNORECASE | re.VERBOSE):
        return ""
    prefix = []
    for op, value in parsed:
        if op is not _regex_parser.LITERAL:
            break
        prefix.append(chr(value))
    return "".join(prefix)


# A rule starting with one of these has no literal prefix: any character
# (`.`), a group or flags (`(`), a set (`[`), an anchor (`^`, `$`), or an
# empty alternative (`|`).
_NOT_LITERAL_START = frozenset(".([^$|")


class Matcher:
    """First-rule-wins matching of many regexes against a key.

    A key is tried only against the rules that can match it: those without a
    literal prefix ("broad" rules, such as `.*kernel`), and those whose
    literal prefix the key starts with (found with one dict look-up per
    distinct prefix length). Candidates are taken in blocks of at most
    `BLOCK` consecutive rules; the candidates of one block are joined into
    one alternation of named groups, compiled once per distinct candidate
    set. For `fullmatch`, Python's regex engine tries the branches in order,
    so the branch that matches is the first rule, in insertion order, that
    matches the whole key. Blocks keep every compiled alternation small
    (a regex of thousands of groups compiles slowly and matches more slowly
    than a plain loop), so matching never costs more than trying the rules
    one by one; a candidate set is compiled only after it has been tried
    `JOIN_AFTER` times. Rules that cannot be joined (numbered back-references,
    clashing group names, inline flags) are tried one by one.
    """

    BLOCK = 32
    JOIN_AFTER = 256

    def __init__(self, rules, patterns=None):
        self.rules = list(rules)
        patterns = patterns or {}
        self.compiled = [patterns.get(r) or re.compile(r) for r in self.rules]
        # What each rule's regex really is (a rule may be compiled from
        # another pattern than its key: see `RuleMap(search=True)`).
        self.sources = [c.pattern for c in self.compiled]
        broad = {}  # block number -> [rule index, ...]
        self.by_length = {}  # prefix length -> {prefix: [rule index, ...]}
        for i, source in enumerate(self.sources):
            prefix = literal_prefix(source)
            if prefix:
                table = self.by_length.setdefault(len(prefix), {})
                table.setdefault(prefix, []).append(i)
            else:
                broad.setdefault(i // self.BLOCK, []).append(i)
        self.broad = {b: tuple(v) for b, v in broad.items()}
        self._block_cache = {}  # candidate indices -> _Block
        self._first_memo = {}  # key -> first rule, for keys `all` has seen
        self.broad_blocks = [self._block(self.broad[b]) for b in sorted(self.broad)]

    def _block(self, indices):
        block = self._block_cache.get(indices)
        if block is None:
            block = self._block_cache[indices] = _Block(self, indices)
        return block

    def _blocks(self, key):
        """The candidate rules for `key` as `_Block`s, in rule order."""
        hits = {}
        for length, table in self.by_length.items():
            found = table.get(key[:length])
            if found:
                for i in found:
                    hits.setdefault(i // self.BLOCK, []).append(i)
        if not hits:
            return self.broad_blocks
        return [
            self._block(tuple(sorted(self.broad.get(b, ()) + tuple(hits.get(b, ())))))
            for b in sorted(set(self.broad) | set(hits))
        ]

    def all(self, key):
        """Indices of every rule that fullmatches `key`, in rule order."""
        found = []
        for block in self._blocks(key):
            joined = block.joined()
            if joined is None:
                found.extend(block.tried(key))
                continue
            m = joined.fullmatch(key)
            if m is None:
                continue
            first = int(m.lastgroup[4:])
            found.append(first)
            rest = [i for i in block.indices if i > first]
            found.extend(i for i in rest if self.compiled[i].fullmatch(key))
        if len(self._first_memo) >= 4096:
            self._first_memo.clear()
        self._first_memo[key] = found[0] if found else None
        return found

    def first(self, key):
        """Index of the first rule that fullmatches `key`, or None."""
        if key in self._first_memo:  # `all(key)` ran: explain, then resolve
            return self._first_memo[key]
        for block in self._blocks(key):
            joined = block.joined()
            if joined is None:
                hit = next(block.tried(key), None)
                if hit is not None:
                    return hit
                continue
            m = joined.fullmatch(key)
            if m is not None:
                return int(m.lastgroup[4:])
        return None


class _Block:
    """Up to `Matcher.BLOCK` candidate rules, tried one by one until they
    have been tried `JOIN_AFTER` times, then as one compiled alternation
    (compiling costs about as much as a few hundred one-by-one tries, so a
    map looked up a few times never pays more than a plain loop, and a big
    model pays the compile back)."""

    __slots__ = ("indices", "patterns", "uses", "_joined", "_matcher")

    def __init__(self, matcher, indices):
        self._matcher = matcher
        self.indices = indices
        self.patterns = tuple(matcher.compiled[i] for i in indices)
        self.uses = 0 if len(indices) > 1 else -1  # -1: never join
        self._joined = None

    def tried(self, key):
        """The rules that fullmatch `key`, lazily, in order; the loop runs
        in C (compress over map)."""
        return itertools.compress(
            self.indices, map(_FULLMATCH, self.patterns, itertools.repeat(key))
        )

    def joined(self):
        if self.uses < 0:
            return self._joined
        self.uses += 1
        if self.uses < Matcher.JOIN_AFTER:
            return None
        self.uses = -1
        rules = self._matcher.sources
        if not any(_UNJOINABLE.search(rules[i]) for i in self.indices):
            try:
                self._joined = re.compile(
                    "|".join(f"(?P<_klm{i}>{rules[i]})" for i in self.indices)
                )
            except re.error:
                self._joined = None
        return self._joined


_FULLMATCH = re.Pattern.fullmatch
# Rules that cannot be joined into one alternation: numbered back-references
# and named ones refer to groups by number or name; inline global flags must
# start the whole pattern.
_UNJOINABLE = re.compile(r"\\\d|\(\?P=|\(\?[aiLmsux]+\)")
