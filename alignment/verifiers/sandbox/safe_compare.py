"""Trusted comparisons for the python_tests sandbox: the tests judge the solution's values, not
objects that claim to be equal.

`compile_tests(source)` rewrites the tests (`rewrite`) so that every comparison, the truth of
conditions, ``isinstance(...)`` and unittest's ``assertEqual`` family call this module's helpers
instead of the operands' own methods, and attribute loads on modules read the value the module had
before the solution ran (`freeze_modules`). Values are judged as *builtin data* (`canonical`), read
through the builtin types' C methods, so no override of ``__eq__``, ``__bool__`` or ``__class__`` is
ever called; two other objects compare only if of the same type (rules: docs/sandbox.md).

Standard library only: `harness.py` runs this file's text inside the sandbox, in a private
namespace, before the untrusted code runs.

    tests = compile_tests("assert add(1, 2) == 3")
    exec(tests, {"add": lambda a, b: a + b})
"""

from __future__ import annotations

import ast
import contextlib
import operator
import re
import types
import warnings

_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class written in Python (or a C extension's heap type)
_type_flags = type.__dict__["__flags__"].__get__
_class_mro = type.__dict__["__mro__"].__get__
_class_dict = type.__dict__["__dict__"].__get__


class Opaque(Exception):
    """Raised by `canonical` for a value that is not builtin data."""


_ATOMS = frozenset(
    {type(None), bool, int, float, complex, str, bytes, bytearray, range, type, type(...), type(NotImplemented)}
)
# builtin base -> its own C method that returns the data of a subclass instance as the exact type
_READERS = (
    (int, int.__index__),
    (float, float.__float__),
    (complex, lambda x: complex(complex.__dict__["real"].__get__(x), complex.__dict__["imag"].__get__(x))),
    (str, str.__str__),
    (bytes, lambda x: bytes(memoryview(x))),
    (bytearray, bytearray.copy),
    (list, list.copy),
    (tuple, lambda x: tuple(tuple.__iter__(x))),
    (dict, dict.copy),
    (set, set.copy),
    (frozenset, lambda x: frozenset(frozenset.__iter__(x))),
)


def canonical(value):
    """The value as exact builtin types, read without calling any method the value's class
    defines; Opaque if it is not builtin data."""
    kind = type(value)
    if kind in _ATOMS:
        return value
    if kind is list or kind is tuple or kind is set or kind is frozenset:
        return kind([canonical(item) for item in value])
    if kind is dict:
        return {canonical(k): canonical(v) for k, v in value.items()}
    for base, read in _READERS:
        if issubclass(kind, base):
            return canonical(read(value))
    raise Opaque(kind)


def _builtin(value):
    """(True, canonical value) or (False, None)."""
    try:
        return True, canonical(value)
    except Opaque:
        return False, None


def _is_heap_type(kind) -> bool:
    return bool(_type_flags(kind) & _HEAPTYPE)


def _defines(kind, name) -> bool:
    """Whether a class in kind's MRO below `object` defines `name` (read without attribute hooks)."""
    return any(name in _class_dict(klass) for klass in _class_mro(kind) if klass is not object)


_OPERATORS = {
    "==": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
}


def _strict_truth(result) -> bool:
    # a comparison result that is not builtin data (an object from a lying __eq__) counts as False
    ok, value = _builtin(result)
    return bool(value) if ok else False


def _compare_one(op: str, left, right) -> bool:
    if op == "is":
        return left is right
    if op == "is not":
        return left is not right
    if op == "in":
        return _contains(right, left)
    if op == "not in":
        return not _contains(right, left)
    left_ok, a = _builtin(left)
    right_ok, b = _builtin(right)
    if left_ok and right_ok:
        return _OPERATORS[op](a, b)
    if not left_ok and not right_ok and type(left) is type(right):
        return _strict_truth(_OPERATORS[op](left, right))
    return op == "!="  # builtin data against anything else, or two unrelated types: never equal


def compare(ops: tuple, *operands) -> bool:
    """`operands[0] ops[0] operands[1] ops[1] ...` judged as docs/sandbox.md ("How the tests judge values") describes.
    All operands are evaluated first (a chain does not short-circuit)."""
    _check_builtins()
    return all(_compare_one(op, operands[i], operands[i + 1]) for i, op in enumerate(ops))


def _materialize(container):
    """Builtin data to search, or None: builtin iterators, generators and views are read out."""
    ok, value = _builtin(container)
    if ok:
        return value
    if not _is_heap_type(type(container)) and hasattr(type(container), "__iter__"):
        return [item for ok, item in map(_builtin, container) if ok]
    return None


def _contains(container, member) -> bool:
    searched = _materialize(container)
    if searched is None:
        if _defines(type(container), "__contains__"):  # the solution's own class answers for itself
            return _strict_truth(member in container)
        searched = [item for ok, item in map(_builtin, container) if ok]
    ok, value = _builtin(member)
    return ok and value in searched


def truth(value) -> bool:
    """bool(value) without calling methods of builtin data's subclasses; C types keep their own
    truth, a Python class's instance uses its own __bool__/__len__ (it cannot claim anything a
    plain True or False could not)."""
    ok, data = _builtin(value)
    return bool(data) if ok else bool(value)


def isinstance_(obj, classinfo) -> bool:
    """isinstance by the object's real type: a `__class__` property cannot claim another class."""
    return issubclass(type(obj), classinfo)


# module id -> (module, its attributes before the solution ran); filled by freeze_modules
_FROZEN: dict = {}
_FROZEN_BY_NAME: dict = {}


def freeze_modules(modules: dict) -> None:
    """Remember every loaded module's attributes (call before the untrusted code runs)."""
    for name, module in list(modules.items()):
        if type(module) is types.ModuleType:
            _FROZEN[id(module)] = (module, dict(vars(module)))
            _FROZEN_BY_NAME[name] = module


def attribute(obj, name: str):
    """obj.name, but a frozen module's function or class as it was before the solution ran (other
    attributes, such as sys.stdout, stay live: tests redirect them)."""
    if type(obj) is types.ModuleType:
        frozen = _FROZEN.get(id(obj))
        if frozen is not None and frozen[0] is obj and callable(frozen[1].get(name)):
            return frozen[1][name]
    return getattr(obj, name)


def modules_tampered() -> list[str]:
    """`module.name` for each function or class of a frozen module that was replaced since."""
    changed = []
    for module, before in list(_FROZEN.values()):
        now = vars(module)
        changed += [
            f"{module.__name__}.{key}" for key, old in before.items() if callable(old) and now.get(key, old) is not old
        ]
    return changed


# Functions handed to the untrusted side (the tests' __import__ and __build_class__, the sandbox's
# signal()) are made here, in a namespace of their own with empty builtins: their globals lead to
# nothing, they keep what they need in defaults (the harness denies rebinding __defaults__) or in a
# suspended generator (whose frame it denies), and they have no closure cells to rewrite.
_ISOLATED = """
def seal(function, adapt, failure=BaseException):
    def body():
        request = yield
        while True:
            try:
                args, kwargs = adapt(*request)
                outcome = (True, function(*args, **kwargs))
            except failure as exc:
                outcome = (False, exc)
            request = yield outcome
    generator = body()
    generator.send(None)
    def call(*args, _send=generator.send, **kwargs):
        ok, value = _send((args, kwargs))
        if ok:
            return value
        raise value
    return call

def frameless(handler):
    return lambda signum, frame, _handler=handler: _handler(signum, None)

def recorder(build, secret):
    def body():
        found = []
        while True:
            try:
                found.append((yield))
            except secret:
                yield found[:]
    generator = body()
    generator.send(None)
    def build_class(*args, _build=build, _record=generator.send, **kwargs):
        cls = _build(*args, **kwargs)
        _record(cls)
        return cls
    return build_class, generator.throw

def importer(frozen, real_import):
    def import_(name, globals=None, locals=None, fromlist=(), level=0, _frozen=frozen, _import=real_import):
        if level == 0:
            module = _frozen.get(name if fromlist else name.partition(".")[0])
            if module is not None and (not fromlist or name in _frozen):
                return module
        return _import(name, globals, locals, fromlist, level)
    return import_
"""


def isolated() -> dict:
    """seal, frameless, recorder and importer, defined in a namespace that holds nothing else."""
    namespace = {"__builtins__": {}, "BaseException": BaseException}
    exec(compile(_ISOLATED, "isolated.py", "exec"), namespace)
    return namespace


class _Retrieve(Exception):
    """Thrown into the class recorder to read it out; only this module holds the class."""


_TESTS_BUILTINS: dict = {}
_PRISTINE_BUILTINS: dict = {}
_READ_CLASSES: list = []


def tests_builtins(builtins_dict: dict, real_import) -> dict:
    """A private copy of the builtins for the tests: `import` returns the frozen modules (a fake
    module put in sys.modules does not reach the tests) and every class statement is recorded, so
    a TestCase cannot be hidden by deleting it from the namespace."""
    tools = isolated()
    build_class, read = tools["recorder"](builtins_dict["__build_class__"], _Retrieve)
    import_ = tools["importer"](types.MappingProxyType(dict(_FROZEN_BY_NAME)), real_import)
    _READ_CLASSES.append(read)
    _PRISTINE_BUILTINS.update(builtins_dict, __import__=import_, __build_class__=build_class)
    _TESTS_BUILTINS.update(_PRISTINE_BUILTINS)
    return _TESTS_BUILTINS


def test_cases(base) -> list:
    """The subclasses of `base` (unittest.TestCase) the tests defined, in order. Raises if the
    recorder was stopped (a generator thrown into or closed from inside)."""
    classes = _READ_CLASSES[0](_Retrieve) if _READ_CLASSES else ()
    return [cls for cls in classes if type(cls) is type and issubclass(cls, base)]


def shadowed_builtins(source: str, namespace: dict) -> list[str]:
    """Builtins the tests read that the solution rebound in the shared namespace (abs = lambda x: 0
    would make every tolerance check pass)."""
    stored, loaded = set(), set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else stored).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            stored.add(node.name)
        elif isinstance(node, ast.arg):
            stored.add(node.arg)
        elif isinstance(node, ast.alias):
            stored.add((node.asname or node.name).partition(".")[0])
    return sorted(
        name
        for name in loaded - stored
        if not name.startswith("__")
        and name in _PRISTINE_BUILTINS
        and name in namespace
        and namespace[name] is not _PRISTINE_BUILTINS[name]
    )


def _check_builtins() -> None:
    # the tests' builtins are reachable from the solution's functions (globals()['__builtins__'])
    if _TESTS_BUILTINS and any(_TESTS_BUILTINS.get(k) is not v for k, v in _PRISTINE_BUILTINS.items()):
        raise AssertionError("the tests' builtins were modified while the tests ran")


def builtins_intact(namespace: dict) -> bool:
    try:
        _check_builtins()
    except AssertionError:
        return False
    return namespace.get("__builtins__") is _TESTS_BUILTINS


def _brief(value) -> str:
    # never the value's own __repr__: output only, but it must not run the solution's code
    ok, data = _builtin(value)
    text = repr(data) if ok else f"<{type(value).__qualname__} object>"
    return text if len(text) <= 200 else text[:200] + "..."


def _almost_equal(first, second, places=None, delta=None) -> bool:
    ok_a, a = _builtin(first)
    ok_b, b = _builtin(second)
    if not (ok_a and ok_b):
        return False
    if a == b:
        return True
    if not all(isinstance(x, (int, float, complex)) for x in (a, b)):
        return False
    difference = abs(a - b)
    return difference <= delta if delta is not None else round(difference, 7 if places is None else places) == 0


def _count_equal(first, second) -> bool:
    remaining = list(_materialize(second) or ())
    items = list(_materialize(first) or ())
    for item in items:
        for i, other in enumerate(remaining):
            if _compare_one("==", item, other):
                del remaining[i]
                break
        else:
            return False
    return not remaining


_EQUAL = (
    "assertEqual",
    "assertEquals",
    "failUnlessEqual",
    "assertListEqual",
    "assertTupleEqual",
    "assertDictEqual",
    "assertSetEqual",
    "assertSequenceEqual",
    "assertMultiLineEqual",
)
_UNITTEST = {
    **{name: (2, lambda a, b: _compare_one("==", a, b), "{} != {}") for name in _EQUAL},
    **{
        name: (2, lambda a, b: _compare_one("!=", a, b), "{} == {}")
        for name in ("assertNotEqual", "assertNotEquals", "failIfEqual")
    },
    **{name: (1, truth, "{} is not true") for name in ("assertTrue", "assert_", "failUnless")},
    **{name: (1, lambda a: not truth(a), "{} is not false") for name in ("assertFalse", "failIf")},
    "assertIn": (2, lambda a, b: _contains(b, a), "{} not found in {}"),
    "assertNotIn": (2, lambda a, b: not _contains(b, a), "{} unexpectedly found in {}"),
    "assertIs": (2, operator.is_, "{} is not {}"),
    "assertIsNot": (2, operator.is_not, "unexpectedly identical: {} {}"),
    "assertIsNone": (1, lambda a: a is None, "{} is not None"),
    "assertIsNotNone": (1, lambda a: a is not None, "unexpectedly None: {}"),
    "assertIsInstance": (2, isinstance_, "{} is not an instance of {}"),
    "assertNotIsInstance": (2, lambda a, b: not isinstance_(a, b), "{} is an instance of {}"),
    "assertGreater": (2, lambda a, b: _compare_one(">", a, b), "{} not greater than {}"),
    "assertGreaterEqual": (2, lambda a, b: _compare_one(">=", a, b), "{} not greater than or equal to {}"),
    "assertLess": (2, lambda a, b: _compare_one("<", a, b), "{} not less than {}"),
    "assertLessEqual": (2, lambda a, b: _compare_one("<=", a, b), "{} not less than or equal to {}"),
    "assertCountEqual": (2, _count_equal, "element counts differ: {} {}"),
}
_ALMOST = (
    "assertAlmostEqual",
    "assertAlmostEquals",
    "failUnlessAlmostEqual",
    "assertNotAlmostEqual",
    "assertNotAlmostEquals",
    "failIfAlmostEqual",
)


_RAISES = ("assertRaises", "assertRaisesRegex", "assertRaisesRegexp")


class _Raises:
    """assertRaises as a context: unittest's own clears the traceback's frames, which the sandbox
    does not hand out."""

    def __init__(self, name, expected, pattern=None, msg=None):
        self.name, self.expected, self.pattern, self.msg = name, expected, pattern, msg
        self.exception = None

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if kind is None:
            raise AssertionError(self.msg or f"{_brief(self.expected)} not raised by {self.name}")
        if not issubclass(kind, self.expected):
            return False
        if self.pattern is not None and not re.search(self.pattern, str(exc)):
            raise AssertionError(self.msg or f"{self.pattern!r} does not match {str(exc)!r}")
        self.exception = exc
        return True


def _raises(name, args, kwargs):
    expected, *rest = args
    pattern = rest.pop(0) if name != "assertRaises" else None
    context = _Raises(name, expected, pattern, kwargs.pop("msg", None) if not rest else None)
    if not rest:
        return context
    with context:
        rest[0](*rest[1:], **kwargs)
    return None


def unittest_assert(name: str, case, *args, **kwargs):
    """`case.<name>(*args)` for unittest's comparison and raises asserts, judged by this module."""
    if name in _RAISES:
        return _raises(name, args, kwargs)
    msg, places, delta = (kwargs.pop(key, None) for key in ("msg", "places", "delta"))
    if name in _ALMOST:
        first, second, *rest = args
        places = rest[0] if rest else places
        msg = rest[1] if len(rest) > 1 else msg
        expected = not name.startswith(("assertNot", "failIf"))
        if _almost_equal(first, second, places, delta) != expected:
            raise AssertionError(msg or f"{_brief(first)} vs {_brief(second)}: {name} failed")
        return
    arity, check, template = _UNITTEST[name]
    values, rest = args[:arity], args[arity:]
    if len(values) < arity or kwargs:
        raise TypeError(f"{name}() got unexpected arguments")
    if not check(*values):
        raise AssertionError((rest[0] if rest else msg) or template.format(*map(_brief, values)))


def subtest(case, *args, **kwargs):
    """case.subTest(...): a context that lets failures through (the first one fails the test)."""
    return contextlib.nullcontext()


UNITTEST_NAMES = frozenset(_UNITTEST) | frozenset(_ALMOST) | frozenset(_RAISES)
HELPERS = {
    f"\0alignment.safe_compare.{f.__name__}\0": f
    for f in (compare, truth, isinstance_, attribute, unittest_assert, subtest)
}
COMPARE, TRUTH, ISINSTANCE, ATTRIBUTE, UNITTEST, SUBTEST = HELPERS
_OP_NAMES = {
    ast.Eq: "==",
    ast.NotEq: "!=",
    ast.Lt: "<",
    ast.LtE: "<=",
    ast.Gt: ">",
    ast.GtE: ">=",
    ast.In: "in",
    ast.NotIn: "not in",
    ast.Is: "is",
    ast.IsNot: "is not",
}


def _helper_call(placeholder: str, args: list, node: ast.AST, keywords=()) -> ast.Call:
    """placeholder(*args), located at node (a call of a str constant until _inject replaces it)."""
    call = ast.Call(ast.Constant(placeholder), args, list(keywords))
    call.trusted_bool = placeholder in (COMPARE, TRUTH, ISINSTANCE)
    return ast.fix_missing_locations(ast.copy_location(call, node))


class _Rewriter(ast.NodeTransformer):
    def visit_Compare(self, node):
        self.generic_visit(node)
        ops = ast.Tuple([ast.Constant(_OP_NAMES[type(op)]) for op in node.ops], ast.Load())
        return _helper_call(COMPARE, [ops, node.left, *node.comparators], node)

    def visit_Attribute(self, node):
        self.generic_visit(node)
        if not isinstance(node.ctx, ast.Load):
            return node
        return _helper_call(ATTRIBUTE, [node.value, ast.Constant(node.attr)], node)

    def visit_Call(self, node):
        func = node.func
        if isinstance(func, ast.Attribute) and (func.attr in UNITTEST_NAMES or func.attr == "subTest"):
            args = [self.visit(func.value), *map(self.visit, node.args)]
            keywords = [self.visit(k) for k in node.keywords]
            if func.attr == "subTest":
                return _helper_call(SUBTEST, args, node, keywords)
            return _helper_call(UNITTEST, [ast.Constant(func.attr), *args], node, keywords)
        self.generic_visit(node)
        if isinstance(func, ast.Name) and func.id == "isinstance" and len(node.args) == 2 and not node.keywords:
            return _helper_call(ISINSTANCE, node.args, node)
        return node

    def visit_UnaryOp(self, node):
        self.generic_visit(node)
        if isinstance(node.op, ast.Not):
            node.operand = _as_truth(node.operand)
        return node

    def _test(self, node):
        self.generic_visit(node)
        node.test = _as_truth(node.test)
        return node

    visit_Assert = visit_If = visit_While = visit_IfExp = _test

    def visit_comprehension(self, node):
        self.generic_visit(node)
        node.ifs = [_as_truth(test) for test in node.ifs]
        return node


def _as_truth(expr: ast.expr) -> ast.expr:
    """A condition whose truth comes from the helpers: comparisons already do; and/or/not apply
    to each operand; anything else goes through truth()."""
    if getattr(expr, "trusted_bool", False):
        return expr
    if isinstance(expr, ast.BoolOp):
        expr.values = [_as_truth(v) for v in expr.values]
        return expr
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Not):
        return expr  # visit_UnaryOp already made its operand a trusted truth
    return _helper_call(TRUTH, [expr], expr)


def rewrite(tree: ast.Module) -> ast.Module:
    """The tests' AST with comparisons, conditions and attribute loads routed to the helpers."""
    return ast.fix_missing_locations(_Rewriter().visit(tree))


def _inject(code: types.CodeType) -> types.CodeType:
    """The code object, and those nested in it, with each placeholder constant replaced by its helper."""
    consts = tuple(
        HELPERS[c] if type(c) is str and c in HELPERS else _inject(c) if type(c) is types.CodeType else c
        for c in code.co_consts
    )
    return code.replace(co_consts=consts)


def compile_tests(source: str, filename: str = "tests.py") -> types.CodeType:
    """Compile the tests rewritten by `rewrite`, with the helpers in place of their placeholders."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)  # "'str' object is not callable": the placeholders
        code = compile(rewrite(ast.parse(source, filename)), filename, "exec")
    return _inject(code)


def _lookup(cls, name: str):
    """cls.name from the class dictionaries along the MRO, past any __getattribute__ hook."""
    for klass in _class_mro(cls):
        namespace = _class_dict(klass)
        if name in namespace:
            return namespace[name]
    return None


def _flag(obj, name: str) -> bool:
    return getattr(obj, name, False) is True


def _run_one(case, name: str, report) -> bool:
    raw = _lookup(case, name)
    expecting_failure = _flag(raw, "__unittest_expecting_failure__")
    instance = case(name)
    try:
        instance.setUp()
        try:
            raw.__get__(instance, case)() if hasattr(type(raw), "__get__") else raw()
        finally:
            instance.tearDown()
            instance.doCleanups()
    except BaseException as exc:  # SkipTest raised while running is a failure, not a pass
        if expecting_failure and isinstance(exc, Exception):
            return True
        report(f"FAIL: {case.__qualname__}.{name}", exc)
        return False
    if expecting_failure:
        report(f"FAIL: {case.__qualname__}.{name} (unexpected success)", None)
        return False
    return True


def run_cases(cases: list, report) -> bool:
    """Run unittest.TestCase classes without unittest's runner and result classes (whose methods
    the solution could replace while the tests run): True if at least one test ran and every test
    passed. Tests and classes skipped by a decorator are left out; setUpModule is not called."""
    ran = passed = 0
    for case in cases:
        if _flag(case, "__unittest_skip__"):
            continue
        names = sorted(n for n in type.__dir__(case) if n.startswith("test") and callable(_lookup(case, n)))
        names = [n for n in names if not _flag(_lookup(case, n), "__unittest_skip__")]
        try:
            case.setUpClass()
        except BaseException as exc:
            report(f"ERROR: {case.__qualname__}.setUpClass", exc)
            return False
        for name in names:
            ran += 1
            passed += _run_one(case, name, report)
        try:
            case.tearDownClass()
        except BaseException as exc:
            report(f"ERROR: {case.__qualname__}.tearDownClass", exc)
            return False
    return ran > 0 and passed == ran
