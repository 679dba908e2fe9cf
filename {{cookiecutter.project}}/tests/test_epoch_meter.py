"""The epoch meter (epoch_meter.py): running sums carried over a stop give the figures of the run that never
stopped, and a stop asked of a rank is read at the next log point."""

import torch

from {{ cookiecutter.package }}.engine.distributed import World
from {{ cookiecutter.package }}.engine.epoch_meter import EpochMeter


def fed(meter: EpochMeter, losses: list[float]) -> EpochMeter:
    for i, loss in enumerate(losses):  # float32 losses, as a step gives them; a batch of 3
        parts = {"aux": torch.tensor(loss / 3, dtype=torch.float32)}
        meter.add(torch.tensor(loss, dtype=torch.float32), torch.tensor(2.0 * loss), parts, 3, i + 1)
    return meter


def test_running_sums_carried_over_a_stop_give_the_straight_figures():
    losses = [0.7310, 1.9137, 0.3333, 2.5e-3, 1.4142, 0.9999, 3.1416]
    world, cpu = World(), torch.device("cpu")
    straight = fed(EpochMeter(cpu), losses)
    window, epoch = straight.read_window(False, world)[0], straight.read_epoch(1.0, False, world)[0]
    assert set(window) == {"loss", "grad_norm", "loss_aux"}
    stopped = fed(EpochMeter(cpu), losses[:4])
    stopped.read_window(False, world, keep=True)  # a stop off the log interval: the window goes on
    resumed = fed(EpochMeter(cpu, stopped.state(world)), losses[4:])
    assert resumed.read_window(False, world)[0] == window and resumed.read_epoch(1.0, False, world)[0] == epoch
    control = fed(EpochMeter(cpu), losses[4:])  # the same steps without the carried sums
    assert control.read_window(False, world)[0]["loss"] != window["loss"]
    assert control.read_epoch(1.0, False, world)[0] != epoch


def test_a_stop_asked_is_read_with_the_window():
    world, cpu = World(), torch.device("cpu")
    meter = fed(EpochMeter(cpu), [0.5, 0.25])
    assert meter.read_window(True, world)[2] is True and meter.read_epoch(1.0, True, world)[2] is True
    assert meter.read_window(False, world)[2] is False  # the control: no stop asked
