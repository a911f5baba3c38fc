// The `standard` plugin: Loom's own callbacks, one component each (standard.hpp).
#include "standard.hpp"

#include <loom/sdk/plugin.hpp>

using namespace loom::callbacks;
using loom::sdk::component;

LOOM_PLUGIN("standard", "1.0.0",
            component<Progress>("progress", "the live progress line: loss, lr, samples/s, ETA, memory"),
            component<Jsonl>("jsonl", "metrics.jsonl: one JSON object per logged step and evaluation"),
            component<TensorBoard>("tensorboard", "TensorBoard event files in <run>/tensorboard"),
            component<Checkpoint>("checkpoint", "step checkpoints every trainer.checkpoint_every steps and at the end"),
            component<Best>("best", "best_<metric>.safetensors at the best evaluation of trainer.best_metric"),
            component<MemorySummary>("memory_summary", "predicted against measured peak memory at the end"),
            component<EarlyStopping>("early_stopping", "stop when a metric stops improving (patience, min_delta)"))
