"""The training loop shared by the tests: forward, loss, `engine.backward`, `engine.step`, per micro-step.

    losses = train(engine, steps, lambda i: batch(i, rank), ga=2)

runs micro-steps `i = step * ga + micro` for `step` in `first_step .. first_step + steps - 1` and
`micro` in `0 .. ga - 1`; each one is exactly

    loss = forward(engine, i)          # default: engine(*inputs(i)) (or engine(inputs(i)) for a tensor)
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())

and after the `ga` micro-steps of each step `after_step(engine, step)` runs. Nothing else touches the
engine: no parameter read, no GatheredParameters, no no_grad forward. What a test does on purpose
around that (an eval forward between steps, a read of the parameters, a measurement around the
forward, a forward inside a GatheredParameters block) stays in the test, in its `forward` or
`after_step` callback, so the operations run in the same order as a hand-written loop.

`ga` is the number of micro-steps per step of the loop (usually the engine's
gradient_accumulation_steps; the engine decides itself at which `engine.step()` it updates).
"""


def train(engine, steps, inputs=None, *, ga=1, first_step=0, forward=None, after_step=None, losses=None):
    """Returns the per-micro-step losses (floats). `losses`: a list to append them to as they come
    (kept by the caller when a step raises part-way)."""
    if (inputs is None) == (forward is None):
        raise TypeError("train() takes either inputs(i) or forward(engine, i)")
    losses = [] if losses is None else losses
    for step in range(first_step, first_step + steps):
        for micro in range(ga):
            i = step * ga + micro
            if forward is not None:
                loss = forward(engine, i)
            else:
                x = inputs(i)
                loss = engine(*x) if isinstance(x, tuple) else engine(x)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        if after_step is not None:
            after_step(engine, step)
    return losses
