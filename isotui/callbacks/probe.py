"""One probe of a model in training: its layer metrics on a fixed probe set, at the steps due.

The measurement is ``isotui.run(model, data, tokenizer=..., cache=False)`` (the API's model-object
path, :mod:`isotui.models.given`) on the model's base (:func:`body`), so a step's numbers are those
of ``isotui.run`` on that step's saved checkpoint. Around it, the model's train/eval flags (that
path restores them), the random number generators (Python's, numpy's global one, torch's CPU and
every initialised CUDA device's: :func:`kept_rng`) and torch's thread count (a run sets it; the
probe runs on the training's unless ``threads=`` says otherwise) come back as they were, so the
training that follows is the one without the probe. ``cache=False``: the weights change every
step, so no entry would ever answer again; the step's layer run is kept in the series folder
instead (:func:`isotui.experiments.recorded.write_step`).

A probe never ends the training: its configuration is checked before the first training step
(:meth:`Probe.start`, :meth:`Probe.check`, and the probe at the start of training, whose failure
refuses the training in one sentence); a probe after a training step that fails (a full disk, a
plug-in metric raising, non-finite hidden states, out of memory...) is said once through the
trainer's logger and skipped (:meth:`Probe.attempt`), with the random number generators, the
threads and the train/eval flags back as they were, so the training goes on as without the probe.
"""

from __future__ import annotations

import gc
import math
import random
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from isotui.callbacks.own_backward import body
from isotui.errors import IsotuiError

if TYPE_CHECKING:
    from isotui.experiments.recorded import GradientSource, SeriesRecord

DEFAULT_EVERY = 100  # steps between probes: measured overhead on train-tiny's model in the docs
DEFAULT_AT_END = True  # a probe at the training's last step too, wherever every= falls
DEFAULT_SAMPLES = 256  # probe-set samples: a few hundred, as the reservoir metrics need
DEFAULT_METRICS = ("avg_cos", "drift_norm", "isoscore", "eff_rank")  # the scalars logged per layer
EXPERIMENTS = ("layers", "gradients")  # what a probe can measure; the layers always
GRAD_METRICS = ("grad_avg_cos", "grad_mean_norm", "top_share")  # logged per layer with gradients
NO_STEP = "no training step ran before it"  # why a probe between steps has no step's own backward


@contextmanager
def kept_rng() -> Iterator[None]:
    """Inside, anything may draw random numbers; after, Python's ``random``, numpy's global
    generator, torch's CPU generator and each initialised CUDA device's are as they were."""
    import numpy as np
    import torch

    py, np_state, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = (
        torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    )
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(np_state)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _metric_names() -> tuple[str, ...]:
    """The float columns of a layer row: the built-in ones, then the plug-in metrics' in force."""
    from isotui.plugins import in_force
    from isotui.results import LayerRow

    own = tuple(f.name for f in fields(LayerRow) if f.type in ("float", float))
    return own + tuple(c for m in in_force() for c in m.columns)


def _whole(value: Any, keyword: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise IsotuiError(f"{keyword}= must be a whole number of at least {minimum} (got {value!r})")
    return value


class Probe:
    """What to measure and when: ``data`` (a data spec as ``isotui run --data`` takes), at most
    ``max_samples`` of it, every ``every`` steps (0: only at ``at``), at the steps ``at`` and,
    with ``at_end`` (default), at the training's last step (the step it stops at: ``max_steps``
    or the step a callback stopped it, early stopping's);
    the layer metrics ``metrics`` logged per layer; the series written to ``out`` (None: none);
    ``experiments``: ``("layers",)`` (default) or ``("layers", "gradients")``: the gradients
    experiment's metrics too (``top_k`` principal directions), from the step's own backward when
    the callback could hook it (:mod:`isotui.callbacks.own_backward`), else on the probe set;
    ``options``: any other keyword of :func:`isotui.run` (``max_length``, ``batch_size``,
    ``reservoir``, ``seed``, ``special_tokens``...), checked at the first probe."""

    def __init__(
        self,
        data: str = "builtin",
        *,
        every: int = DEFAULT_EVERY,
        at: Iterable[int] = (),
        max_samples: int = DEFAULT_SAMPLES,
        metrics: Iterable[str] = DEFAULT_METRICS,
        out: str | Path | None = None,
        experiments: Iterable[str] = ("layers",),
        top_k: int = 10,
        at_end: bool = DEFAULT_AT_END,
        **options: Any,
    ) -> None:
        if not isinstance(data, str) or not data:
            raise IsotuiError(
                f"data= must be a data spec as isotui run --data takes, e.g. 'builtin' (got {data!r})"
            )
        self.data = data
        self.every = _whole(every, "every", 0)
        self.at = frozenset(_whole(s, "at", 0) for s in ([at] if isinstance(at, int) else at))
        if not isinstance(at_end, bool):
            raise IsotuiError(
                f"at_end= is True (a probe at the training's last step) or False (got {at_end!r})"
            )
        self.at_end = at_end
        if self.every == 0 and not self.at and not self.at_end:
            raise IsotuiError(
                "every=0 with at_end=False probes only at the steps of at=, and at= is empty: give either"
            )
        self.max_samples = _whole(max_samples, "max_samples", 1)
        known = _metric_names()
        self.metrics = tuple([metrics] if isinstance(metrics, str) else metrics)
        for m in self.metrics:
            if m not in known:
                raise IsotuiError(
                    f"metrics= has {m!r}, which is no layer metric; give some of {', '.join(known)}"
                )
        for key in ("cache", "cache_dir", "progress", "tokenizer", "processor", "name", "config"):
            if key in options:
                raise IsotuiError(f"{key}= is the probe's own to set, not a run option of the probe")
        self.experiments = tuple([experiments] if isinstance(experiments, str) else experiments)
        if "layers" not in self.experiments or not set(self.experiments) <= set(EXPERIMENTS):
            raise IsotuiError(
                f"experiments= must be ('layers',) or ('layers', 'gradients') (got {self.experiments!r}); "
                "the series is the layer runs, gradients come beside them"
            )
        self.gradients = "gradients" in self.experiments
        self.top_k = _whole(top_k, "top_k", 1)
        self.options = options
        self.out = Path(out).expanduser() if out is not None else None
        self.record: SeriesRecord | None = None
        self.done: set[int] = set()
        self.skipped: dict[int, str] = {}  # step -> why its probe failed (the training went on)
        self._said: set[str] = set()  # the failures said so far, each once
        self.own: Any = None  # the coming step's armed StepGradients, when it is probed with gradients
        self.no_own = NO_STEP  # else why its gradients come from the probe set

    def due(self, step: int, *, last: bool = False) -> bool:
        """Whether ``step`` is probed (each step once); ``last``: it is the training's last step
        (probed with ``at_end``)."""
        if step in self.done:
            return False
        return step in self.at or (self.every > 0 and step % self.every == 0) or (last and self.at_end)

    def start(self, out: str | Path | None = None) -> None:
        """Before the first probe: the series folder (``out`` unless given at construction), made
        or refused in one sentence (:func:`isotui.experiments.recorded.prepare_out`)."""
        from isotui.experiments.recorded import new_record, prepare_out

        if self.out is None and out is not None:
            self.out = Path(out).expanduser()
        if self.out is not None and self.record is None:
            prepare_out(self.out)
            self.record = new_record(
                {"data": self.data, "max_samples": self.max_samples, "every": self.every, **self.options}
                | {"at": sorted(self.at), "at_end": self.at_end, "experiments": list(self.experiments)}
                | ({"top_k": self.top_k} if self.gradients else {})
            )

    def check(self, model: Any, *, tokenizer: Any = None, processor: Any = None) -> None:
        """Before the first training step: what a probe of ``model`` would be refused for (its run
        options, the data spec, the tokenizer or processor; with gradients, the gradients
        experiment's), in one sentence (:func:`isotui.api.check_object`), nothing measured."""
        from isotui.api import check_object

        options = {"max_samples": self.max_samples, **self.options}
        check_object("layers", body(model), self.data, tokenizer=tokenizer, processor=processor, **options)
        if self.gradients:
            check_object(
                "gradients", model, self.data, tokenizer=tokenizer, top_k=self.top_k, **options
            )  # fmt: skip

    def attempt(
        self,
        step: int,
        work: Callable[[], Any],
        say: Callable[[str], None],
        *,
        model: Any = None,
        before_training: bool = False,
    ) -> Any:
        """``work()`` (a probe at ``step``, or arming one), its value; if it fails: before the
        training's first step (``before_training``), the failure refuses the training as one
        sentence (an :class:`IsotuiError`); after it, the failure is said through ``say`` (once
        for each reason: a full disk is not said at every later step), the step is listed in
        :attr:`skipped` and None returned, so the training goes on. ``model``: looked at for
        non-finite weights when a probe fails (a diverging training, said so)."""
        try:
            return work()
        except Exception as exc:  # a probe never ends the training
            if before_training and isinstance(exc, IsotuiError):
                raise
            reason = _reason(exc)
        _release_memory()  # what the failed probe held (an out-of-memory's traceback's tensors)
        if model is not None and _diverged(model):
            reason += "; the model's weights hold NaN or inf (is the training diverging?)"
        if before_training:
            raise IsotuiError(f"the probe at step {step}, before training, failed: {reason}")
        from isotui.experiments.recorded import step_dir_name

        self.done.add(step)
        self.skipped[step] = reason
        same = reason.replace(step_dir_name(step), "step_*")  # a step's folder named: the same failure
        if same not in self._said:
            self._said.add(same)
            say(
                f"isotui: the probe at step {step} failed and is skipped, the training goes on as without "
                f"it ({reason}); a later probe failing the same way is skipped without a word"
            )
        return None

    def wants_hooks(self, coming: int, max_steps: int) -> bool:
        """Whether the step ``coming`` is probed with gradients (``max_steps`` <= 0: no limit)."""
        return self.gradients and self.due(coming, last=0 < max_steps <= coming)

    def arm(self, model: Any, tokenizer: Any) -> None:
        """Hook the coming step's own backward (:class:`~isotui.callbacks.own_backward.StepGradients`);
        a failure leaves the probe set's gradients, said in ``no_own``: the step is never harmed."""
        from isotui.callbacks.own_backward import StepGradients

        try:
            self.own = StepGradients(model, tokenizer, self.top_k, int(self.options.get("seed", 0))).arm()
        except Exception as exc:
            self.no_own = f"its hooks could not be set ({type(exc).__name__}: {exc})"

    @contextmanager
    def closing_step(self) -> Iterator[None]:
        """Around a step's probe: the step's hooks disarmed and dropped after it, however it ends."""
        try:
            yield
        finally:
            if self.own is not None:
                self.own.disarm()
            self.own, self.no_own = None, NO_STEP

    @contextmanager
    def after_training(self) -> Iterator[None]:
        """Around the probe at the training's end, after its last step: no step's backward to read."""
        self.no_own = "probed at the end of training, after its last step"
        try:
            yield
        finally:
            self.no_own = NO_STEP

    def measure(
        self,
        model: Any,
        step: int,
        *,
        tokenizer: Any = None,
        processor: Any = None,
        **facts: Any,
    ) -> dict[str, float]:
        """Probe ``model`` at ``step``: the scalars to log (``isotui/METRIC/layer_L``, the
        encoder's and decoder's ``isotui/METRIC/encoder_layer_L``...), the layer run written to
        the series folder with ``facts`` beside it. With gradients: ``own`` (the step's
        :class:`~isotui.callbacks.own_backward.StepGradients`, disarmed here, see :meth:`arm`)
        gives them, else the gradients experiment runs on the probe set (``no_own`` or ``own``'s
        reason recorded).
        Mode, random states and threads as they were, whether it succeeds or fails."""
        import torch

        from isotui.api import Result, run

        if self.own is not None:  # the step is over: the probe's own forwards are not its
            self.own.disarm()
        started = time.perf_counter()
        threads = torch.get_num_threads()  # a run sets torch's threads for the process
        options = {"threads": threads, **self.options}  # by default on the training's threads
        modes = [(m, m.training) for m in model.modules()]  # the run keeps them too; a failure here too
        with kept_rng():  # whatever happens inside, failures included
            try:
                found = run(
                    body(model),
                    self.data,
                    tokenizer=tokenizer,
                    processor=processor,
                    max_samples=self.max_samples,
                    cache=False,
                    progress=False,
                    **options,
                )
                assert isinstance(found, Result)  # one model object: one Result
                result = found.result
                _refuse_non_finite(result)
                gradients, how = None, None
                if self.gradients:
                    gradients, how = self._gradients(model, tokenizer, self.own, self.no_own, threads)
                seconds = time.perf_counter() - started
                self.done.add(step)
                if self.out is not None and self.record is not None:
                    from isotui.experiments.recorded import write_step

                    write_step(
                        self.out,
                        self.record,
                        step,
                        result,
                        gradients=gradients,
                        how=how,
                        seconds=round(seconds, 3),
                        **facts,
                    )
            finally:
                torch.set_num_threads(threads)
                for module, training in modes:
                    module.training = training
        scalars = self.scalars(result)
        if gradients is not None and how is not None:
            scalars |= self.grad_scalars(gradients, how["source"])
        return scalars

    def _gradients(
        self, model: Any, tokenizer: Any, own: Any, no_own: str, threads: int
    ) -> tuple[Any, GradientSource]:
        """The gradients at this step: the step's own backward's, or the probe set's (a language
        model's loss: text, its tokenizer), and how."""
        import torch

        from isotui.api import Result, experiment
        from isotui.callbacks.own_backward import SOURCE_OWN, SOURCE_PROBE

        if own is not None:
            found, problem = own.result()
            if found is not None:
                return found, {"source": SOURCE_OWN}
            no_own = problem or no_own
        with kept_rng():  # (inside measure's too: this one keeps _gradients whole on its own)
            try:  # the whole model: its head gives the loss
                run = experiment(
                    "gradients",
                    model=model,
                    data=self.data,
                    tokenizer=tokenizer,
                    max_samples=self.max_samples,
                    top_k=self.top_k,
                    cache=False,
                    progress=False,
                    **{"threads": threads, **self.options},
                )
            finally:
                torch.set_num_threads(threads)
        assert isinstance(run, Result)
        return run.result, {"source": SOURCE_PROBE, "why": f"not from the step's own backward: {no_own}"}

    def grad_scalars(self, gradients: Any, source: str) -> dict[str, float]:
        """``isotui/grad_avg_cos/layer_L``... and ``isotui/gradients_own_backward`` (1 or 0)."""
        from isotui.callbacks.own_backward import SOURCE_OWN

        out: dict[str, float] = {"isotui/gradients_own_backward": float(source == SOURCE_OWN)}
        for row in gradients.rows:
            for metric in GRAD_METRICS:
                value = float(getattr(row, metric))
                if math.isfinite(value):
                    out[f"isotui/{metric}/layer_{row.layer}"] = value
        return out

    def scalars(self, result: Any) -> dict[str, float]:
        """``isotui/METRIC/layer_L`` for each metric and layer (NaN left out: loggers refuse it)."""
        out: dict[str, float] = {}
        for row in result.rows:
            where = f"layer_{row.layer}" if row.component == "model" else f"{row.component}_layer_{row.layer}"
            for metric in self.metrics:
                value = float(getattr(row, metric))
                if math.isfinite(value):
                    out[f"isotui/{metric}/{where}"] = value
        return out


def _refuse_non_finite(result: Any) -> None:
    """A layer whose vectors are not all finite (NaN or inf: a diverging model) is no measurement:
    one sentence, so the probe is skipped rather than a series of NaN written."""
    bad = [
        f"{row.component} layer {row.layer}" if row.component != "model" else f"layer {row.layer}"
        for row in result.rows
        if row.n_vectors > 0 and not math.isfinite(row.mean_norm)
    ]
    if bad:
        raise IsotuiError(
            f"the hidden states of {', '.join(bad[:3])}{' and others' if len(bad) > 3 else ''} are not "
            "finite (NaN or inf)"
        )


def _reason(exc: BaseException) -> str:
    """A failure in words: an IsotuiError's sentence, else its type and the first line of its message
    (an out-of-memory's runs on for lines)."""
    if isinstance(exc, IsotuiError):
        return str(exc)
    text = (str(exc).strip().splitlines() or [""])[0]
    text = text if len(text) <= 300 else text[:297] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _release_memory() -> None:
    """After a failed probe: its objects freed now (a traceback's frames keep tensors alive in
    reference cycles), and the accelerator's cached blocks given back for the training's steps."""
    import torch

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _diverged(model: Any) -> bool:
    """Whether any floating-point weight of ``model`` is NaN or inf (False if that cannot be told)."""
    import torch

    try:
        with torch.no_grad():
            return any(not bool(torch.isfinite(p).all()) for p in model.parameters() if p.is_floating_point())
    except Exception:  # a question asked after a failure: never a second one
        return False
