"""The schema pass: a JSON schema rewritten, before xgrammar sees it, into one whose every keyword xgrammar
enforces — or refused with the keyword and its JSON path named. Nothing is ignored.

xgrammar 0.2.9 compiles many schemas while silently ignoring keywords (``allOf`` beside ``type``, ``oneOf``
branches that only list ``required``, ``dependencies``, ``maxLength`` beside ``pattern``, ``uniqueItems``,
``not``, ...), so an output could finish with ``stop`` yet break its schema. The pass:

1. resolves local ``$ref`` (``#``, ``#/$defs/x``, any JSON pointer into the document) by inlining; a recursive
   reference stays a ``$ref`` into the output's ``$defs``; a remote one is refused;
2. merges ``allOf`` (and a ``$ref``'s siblings) into one schema (:mod:`deepinfer.grammar.schema_merge`);
3. carries the keywords beside an ``anyOf`` / ``oneOf`` into each branch (a branch they exclude is dropped);
4. rewrites ``dependentRequired`` / ``dependencies`` (array form) into an ``anyOf`` when the object is closed;
5. checks and rewrites each remaining schema's keywords (:mod:`deepinfer.grammar.schema_rules`), and turns
   ``oneOf`` into ``anyOf`` only when its branches are provably disjoint.

The output is never larger than ``max_nodes`` schema nodes (inlining can grow a document exponentially).
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

from deepinfer.grammar.schema_merge import ANNOTATIONS, COMPOSITIONS, Merger, Never
from deepinfer.grammar.schema_rules import check_node, one_of
from deepinfer.grammar.spec import GrammarError

__all__ = ["MAX_NODES", "normalize_schema", "normalize_tag"]

MAX_NODES = 20000
_MAX_DEPENDENCY_BRANCHES = 8
_CHILD_MAPS = ("properties", "patternProperties")
_CHILDREN = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems")


def normalize_schema(schema: dict, max_nodes: int = MAX_NODES) -> dict:
    """The rewritten schema (a new document; ``schema`` is not modified). Raises :class:`GrammarError`
    naming the keyword and path of what cannot be enforced, or saying that the schema accepts no value."""
    return _Pass(schema, max_nodes).run()


def normalize_tag(tag: dict, max_nodes: int = MAX_NODES) -> dict:
    """A structural tag with the schema of each ``json_schema`` format rewritten (a new document); an error
    names the format's path in the tag, then the keyword's path in its schema."""
    out = copy.deepcopy(tag)
    stack: list[tuple[Any, str]] = [(out, "")]
    while stack:
        node, path = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        if isinstance(node, dict) and node.get("type") == "json_schema" and isinstance(node.get("json_schema"), dict):
            try:
                node["json_schema"] = normalize_schema(node["json_schema"], max_nodes)
            except GrammarError as e:
                raise GrammarError(f"structural_tag: {path}/json_schema: {str(e).removeprefix('json_schema: ')}",
                                   e.outcome) from None  # fmt: skip
            continue
        stack.extend((v, f"{path}/{_escape(k)}") for k, v in items if isinstance(v, dict | list))
    return out


def _escape(key: Any) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")


class _Pass:
    def __init__(self, root: dict, max_nodes: int) -> None:
        self.root, self.max_nodes, self.nodes = root, max_nodes, 0
        self.expanding: list[str] = []
        self.recursive: dict[str, str] = {}  # reference -> name in the output's $defs
        self.merger = Merger(self.finish)

    def run(self) -> dict:
        self.expanding = ["#"]
        try:
            out = self.schema(self.root, "")
            defs: dict[str, Any] = {}
            done = 0
            while done < len(self.recursive):  # each recursive target once (it may find further ones)
                ref, name = list(self.recursive.items())[done]
                self.expanding = [ref]
                defs[name] = self.schema(self.resolve(ref, ""), ref[1:])
                done += 1
        except Never as e:
            raise GrammarError(f"json_schema: the schema accepts no value ({e})") from None
        except RecursionError:
            raise GrammarError("json_schema: the schema nests too deeply to rewrite", "limit") from None
        if defs:
            out = {**out, "$defs": defs}
        _drop_false(out)
        return out

    def count(self, path: str) -> None:
        self.nodes += 1
        if self.nodes > self.max_nodes:
            raise GrammarError(
                f"json_schema: {path or '/'}: the schema grows past {self.max_nodes} nodes when its $ref, allOf "
                "and anyOf/oneOf are expanded (the limit)",
                "limit",
            )

    def resolve(self, ref: Any, path: str) -> Any:
        if not isinstance(ref, str) or not ref.startswith("#") or ref.startswith("#") and ref[1:2] not in ("", "/"):
            raise GrammarError(f"json_schema: {path}/$ref: only local references ('#' or '#/...') are supported, not "
                               f"{str(ref)[:80]!r}")  # fmt: skip
        node: Any = self.root
        for part in ref[2:].split("/") if len(ref) > 1 else ():
            key = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and key in node:
                node = node[key]
            elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
                node = node[int(key)]
            else:
                raise GrammarError(f"json_schema: {path}/$ref: {ref[:80]!r} does not resolve in the document")
        return node

    # -- one schema --
    def schema(self, node: Any, path: str) -> dict:
        """The normalized schema of ``node`` (a dict: ``{}`` for true); :class:`Never` for false."""
        self.count(path)
        if node is True:
            return {}
        if node is False:
            raise Never(f"{path or '/'}: the schema false")
        if not isinstance(node, dict):
            raise GrammarError(f"json_schema: {path or '/'}: expected a schema (an object or a boolean)")
        if "$id" in node and path and not str(node["$id"]).startswith("#"):
            raise GrammarError(f"json_schema: {path}/$id: a nested $id (another base URI) is not supported")
        parts: list[dict] = []
        if "$ref" in node:
            parts.append(self.reference(node, path))
        if "allOf" in node:
            members = node["allOf"]
            if not isinstance(members, list) or not members:
                raise GrammarError(f"json_schema: {path}/allOf: expected a non-empty array of schemas")
            parts.extend(self.schema(m, f"{path}/allOf/{i}") for i, m in enumerate(members))
        parts.append(self.local(node, path))
        asserting = [p for p in parts if set(p) - ANNOTATIONS] or parts[-1:]
        merged = asserting[0]
        for part in asserting[1:]:
            merged = self.merger.merge(merged, part, path)
        return self.finish(merged, path)

    def reference(self, node: dict, path: str) -> dict:
        ref = node["$ref"]
        target = self.resolve(ref, path)
        if ref in self.expanding:
            if ref == "#":
                return {"$ref": "#"}  # the output's root is the normalized root
            name = self.recursive.setdefault(ref, f"r{len(self.recursive)}")
            return {"$ref": f"#/$defs/{name}"}
        self.expanding.append(ref)
        try:
            return self.schema(target, path)
        finally:
            self.expanding.pop()

    def local(self, node: dict, path: str) -> dict:
        """``node``'s own keywords, its sub-schemas normalized, then :meth:`finish`."""
        _check_shapes(node, path)
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key in ("$ref", "allOf", "$defs", "definitions"):
                continue
            where = f"{path}/{key}"
            if key in _CHILD_MAPS:
                out[key] = self.properties(value, where, node.get("required", []))
            elif key in _CHILDREN and isinstance(value, dict):
                out[key] = self.schema(value, where)
            elif key == "items" and isinstance(value, list):  # draft 4-7 tuple form
                out["prefixItems"] = [self.schema(v, f"{where}/{i}") for i, v in enumerate(value)]
                extra = node.get("additionalItems", True)
                out["items"] = extra if isinstance(extra, bool) else self.schema(extra, f"{path}/additionalItems")
            elif key == "prefixItems" and isinstance(value, list):
                out[key] = [self.schema(v, f"{where}/{i}") for i, v in enumerate(value)]
            elif key in COMPOSITIONS:
                out[key] = self.branches(value, where)
            elif key == "additionalItems" and isinstance(node.get("items"), list):
                continue
            else:
                out[key] = value
        if "const" in out:
            value = out.pop("const")
            out["enum"] = [v for v in out.get("enum", [value]) if v == value and type(v) is type(value)]
        for bound in ("Minimum", "Maximum"):  # draft 4: a boolean exclusiveMinimum modifies minimum
            flag = out.get(f"exclusive{bound}")
            if isinstance(flag, bool):
                del out[f"exclusive{bound}"]
                if flag and bound.lower() in out:
                    out[f"exclusive{bound}"] = out.pop(bound.lower())
        return self.dependencies(out, path)

    def properties(self, value: Any, path: str, required: Any) -> dict:
        if not isinstance(value, dict):
            raise GrammarError(f"json_schema: {path}: expected an object of schemas")
        out = {}
        for name, schema in value.items():
            try:
                out[name] = self.schema(schema, f"{path}/{_escape(name)}")
            except Never:
                if isinstance(required, list) and name in required:
                    raise
                if path.endswith("/patternProperties"):
                    raise GrammarError(
                        f"json_schema: {path}/{_escape(name)}: a false schema is not supported"
                    ) from None
                # the property may not appear: left out of properties (objects are closed unless
                # additionalProperties says otherwise, and then it is refused below)
                out[name] = False
        return out

    def branches(self, value: Any, path: str) -> list[dict]:
        if not isinstance(value, list) or not value:
            raise GrammarError(f"json_schema: {path}: expected a non-empty array of schemas")
        out = []
        for i, branch in enumerate(value):
            try:
                out.append(self.schema(branch, f"{path}/{i}"))
            except Never:
                continue
        if not out:
            raise Never(f"{path}: no branch accepts a value")
        return out

    def dependencies(self, node: dict, path: str) -> dict:
        """``dependentRequired`` / array-valued ``dependencies`` → required (trigger required) or an anyOf of
        'trigger absent' / 'dependents required' (a closed object only)."""
        deps: dict[str, list] = {}
        keyword = "dependentRequired" if "dependentRequired" in node else "dependencies"
        for key in ("dependentRequired", "dependencies"):
            for trigger, needed in (node.get(key) or {}).items():
                if not isinstance(needed, list):
                    raise GrammarError(f"json_schema: {path}/{key}/{_escape(trigger)}: a schema-valued dependency is "
                                       "not enforced (only lists of property names)")  # fmt: skip
                deps.setdefault(trigger, []).extend(needed)
        if not deps:
            return node
        node = {k: v for k, v in node.items() if k not in ("dependentRequired", "dependencies")}
        required = list(node.get("required", []))
        props = node.get("properties", {})
        changed = True
        while changed:  # a required trigger makes its dependents required, which may be triggers themselves
            changed = False
            for trigger, needed in deps.items():
                if trigger in required and any(n not in required for n in needed):
                    required += [n for n in needed if n not in required]
                    changed = True
        if required:
            node["required"] = required
        closed = node.get("additionalProperties", False) is False and "patternProperties" not in node
        open_triggers = [t for t in deps if t not in required and any(n not in required for n in deps[t])
                         and (props[t] is not False if t in props else not closed)]  # fmt: skip
        if not open_triggers:
            return node
        if not closed:
            raise GrammarError(f"json_schema: {path}/{keyword}: enforced only on objects without "
                               "additionalProperties or patternProperties")  # fmt: skip
        if 2 ** len(open_triggers) > _MAX_DEPENDENCY_BRANCHES or any(k in node for k in COMPOSITIONS):
            raise GrammarError(f"json_schema: {path}/{keyword}: too many dependencies to enforce "
                               f"({len(open_triggers)}; at most 3, and not beside anyOf/oneOf)")  # fmt: skip
        branches = []
        for present in itertools.product((False, True), repeat=len(open_triggers)):
            branch = {**node, "properties": dict(props), "required": list(required)}
            for trigger, on in zip(open_triggers, present):
                if on:
                    branch["required"] += [n for n in deps[trigger] if n not in branch["required"]]
                else:
                    branch["properties"][trigger] = False
            branches.append(branch)
        return {k: v for k, v in node.items() if k in ANNOTATIONS} | {"anyOf": branches}

    def finish(self, node: dict, path: str) -> dict:
        """Distribute the siblings of an anyOf/oneOf into its branches, then check each flat schema."""
        self.count(path)
        kind = next((k for k in COMPOSITIONS if k in node), None)
        if kind is None:
            return check_node(node, path) if "$ref" not in node else node
        siblings = {k: v for k, v in node.items() if k != kind and k not in ANNOTATIONS}
        branches = []
        for i, branch in enumerate(node[kind]):
            where = f"{path}/{kind}/{i}"
            try:
                merged = self.finish(self.merger.merge(siblings, branch, where) if siblings else branch, where)
            except Never:
                continue
            if kind == "anyOf" and set(merged) - ANNOTATIONS == {"anyOf"}:
                branches.extend(merged["anyOf"])
            else:
                branches.append(merged)
        if not branches:
            raise Never(f"{path}/{kind}: no branch accepts a value")
        if len(branches) == 1:
            return branches[0]
        out = one_of(branches, path) if kind == "oneOf" else {"anyOf": branches}
        return {k: v for k, v in node.items() if k in ANNOTATIONS} | out


def _check_shapes(node: dict, path: str) -> None:
    """The keywords whose value the pass reads must have the shape JSON Schema gives them."""
    t = node.get("type")
    if t is not None and not (isinstance(t, str) or isinstance(t, list) and t and all(isinstance(x, str) for x in t)):
        raise GrammarError(f"json_schema: {path}/type: expected a type name or a non-empty list of them")
    required = node.get("required")
    if required is not None and not (isinstance(required, list) and all(isinstance(x, str) for x in required)):
        raise GrammarError(f"json_schema: {path}/required: expected a list of property names")
    if "enum" in node and not isinstance(node["enum"], list):
        raise GrammarError(f"json_schema: {path}/enum: expected a list of values")
    for key in ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties"):
        n = node.get(key)
        if n is not None and (isinstance(n, bool) or not isinstance(n, int | float) or n < 0 or n != int(n)):
            raise GrammarError(f"json_schema: {path}/{key}: expected a non-negative integer")
    for key in ("minimum", "maximum"):
        n = node.get(key)
        if n is not None and (isinstance(n, bool) or not isinstance(n, int | float)):
            raise GrammarError(f"json_schema: {path}/{key}: expected a number")


def _drop_false(document: dict) -> None:
    """Properties whose schema is false leave ``properties`` (in place; xgrammar refuses a false schema): a
    closed object then never has them. In an open object (additionalProperties, patternProperties) refused."""
    stack: list[tuple[Any, str]] = [(document, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, list):
            stack.extend((v, f"{path}/{i}") for i, v in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        props = node.get("properties")
        if isinstance(props, dict) and any(v is False for v in props.values()):
            if node.get("additionalProperties", False) is not False or "patternProperties" in node:
                name = next(k for k, v in props.items() if v is False)
                raise GrammarError(
                    f"json_schema: {path}/properties/{_escape(name)}: a property that may not appear (a false schema, "
                    "or excluded by allOf/dependencies) is supported only in an object without additionalProperties "
                    "or patternProperties"
                )
            node["properties"] = {k: v for k, v in props.items() if v is not False}
        for key, value in node.items():
            if isinstance(value, dict | list) and key not in ("enum", "const", "default", "examples"):
                stack.append((value, f"{path}/{_escape(key)}"))
