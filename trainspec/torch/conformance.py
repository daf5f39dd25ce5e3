"""The torch backend under the conformance suite (`trainspec conformance --impl torch`): its
runtime and collectives (trainspec.torch.runtime) with the reference job's steps and run."""
from __future__ import annotations

from trainspec.core.adapter import Adapter
from trainspec.torch.runtime import TorchRuntime


class TorchConformance(TorchRuntime, Adapter):
    def train_steps(self, spec, params, batches):
        from trainspec.torch.models.transformer import Transformer, from_flax, to_flax
        from trainspec.torch.params_file import whole_params
        from trainspec.torch.train import TorchStep

        step = TorchStep(spec, self.build_mesh(spec), spec.train.steps, self.device,
                         from_flax(Transformer(spec.model), params))
        steps = []
        for batch in batches:
            metrics = step({key: v[step.rows()] for key, v in batch.items()})
            steps.append((metrics["loss"], metrics["grad_norm"],
                          to_flax(step.model, whole_params(step.model, step.stage_group))))
        return steps

    def train_run(self, spec, run_dir, steps):
        from trainspec.torch.train import run

        return run(spec, run_dir, steps=steps, progress=False, adapter=self)
