"""``kareus show`` of a plan prints what its steps measured beside the prediction, and says
that a simulated device's plan measured nothing: every cost of it is modelled."""

import dataclasses

from test_show import console, make_plan

from kareus.devices.base import StepMeasurement
from kareus.show import show

MEASURED = StepMeasurement(first_step=2, steps=5, time_s=0.0125, gpu_energy_j=((0, 2.4), (1, 2.6)),
                           rank=1, world_size=2, method="nvml-energy-counter")


def _shown(plan, tmp_path) -> str:
    out = console()
    show(plan.save(tmp_path / "plan.json"), console=out)
    return out.export_text()


def test_a_measured_plan_shows_its_steps_beside_the_prediction(tmp_path):
    plan = dataclasses.replace(make_plan(), device="nvml:NVIDIA H200", model_version=None,
                               measured=MEASURED)  # predicted: 12.5 ms, 2.5 J
    text = _shown(plan, tmp_path)
    assert ("measured per step (rank 1, steps 2-6, nvml-energy-counter): 12.5 ms, 2.6 J on "
            "its GPU; 5 J on all 2 GPUs: time 1.000x, energy 1.040x of the prediction") in text
    partial = dataclasses.replace(MEASURED, gpu_energy_j=((1, 2.6),))
    text = _shown(dataclasses.replace(plan, measured=partial), tmp_path)
    assert "2.6 J on its GPU; the total waits for all 2 ranks: time" in text


def test_a_simulated_plan_measured_nothing(tmp_path):
    assert ("measured: nothing (the device is simulated: every cost here is modelled)"
            in _shown(make_plan(), tmp_path))
    plan = dataclasses.replace(make_plan(), device="nvml:NVIDIA H200", model_version=None)
    assert "measured: nothing yet (no window of steps ran with this plan)" in _shown(plan, tmp_path)
