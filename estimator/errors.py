"""Typed errors of the estimator: each quotes the bad input and says how to fix it."""


# The most of a bad value an error quotes (its repr).
MAX_SHOWN_CHARS = 200


class SpecError(ValueError):
    """A specification (model, cluster, job, GPU type) is invalid.

    Args:
        field: the name of the offending field, dotted for nested YAML (``nodes[2].gpus``).
        value: the value that was given.
        hint: what to do instead.
    """

    def __init__(self, field: str, value: object, hint: str):
        self.field = field
        self.value = value
        self.hint = hint
        shown = repr(value)
        if len(shown) > MAX_SHOWN_CHARS:  # a whole file parsed into the wrong shape, say
            shown = shown[:MAX_SHOWN_CHARS] + "..."
        super().__init__(f"{field}={shown}: {hint}")

    def __reduce__(self):
        # Crosses process boundaries whole (compile and test worker pools): the default
        # would call SpecError(message) and fail, leaving the pool waiting.
        return (_rebuild, (type(self), self.field, self.value, self.hint))


def _rebuild(cls: type, field: str, value: object, hint: str) -> SpecError:
    """A SpecError (or subclass, whatever its own arguments) with these parts."""
    err = cls.__new__(cls)
    SpecError.__init__(err, field, value, hint)
    return err


def yaml_problem(error: Exception) -> str:
    """A YAML (or text decoding) error in one line, with where it is when YAML knows."""
    problem = getattr(error, "problem", None)  # what is wrong, where str() leads with the context
    text = f"malformed YAML: {problem or str(error).splitlines()[0]}"
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    if mark is not None:
        text += f" (line {mark.line + 1}, column {mark.column + 1})"
    return text
