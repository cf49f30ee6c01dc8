"""``DrainPrograms``: which decode programs ``compile_ahead`` asks for, and when."""

from types import SimpleNamespace

from jaxpage.config import SchedulerConfig
from jaxpage.core.batch.builder import BatchBuilder
from jaxpage.engine.startup.compile_ahead import DrainPrograms
from tests.core.helpers import make_scheduler


class RecordingRunner:
    def __init__(self, platform="cpu"):
        self.asked = []
        self.platform = platform

    def placement_platform(self):
        return self.platform

    def prefetch(self, batch, num_steps):
        self.asked.append((*batch.shape_key, num_steps))
        return True


def queues(running, waiting):
    return SimpleNamespace(running=[None] * running, waiting=[None] * waiting)


def test_the_drain_programs_are_asked_for_largest_first_and_once():
    kv = make_scheduler(num_blocks=64, block_size=4).kv
    builder = BatchBuilder(kv, max_num_batched_tokens=64, max_num_seqs=32, max_model_len=64)
    runner = RecordingRunner()
    drain = DrainPrograms(builder, num_steps=4, max_num_seqs=32)
    prefill = builder.empty(64, 8, 16)                 # the call just dispatched
    drain.after_dispatch(prefill, queues(running=12, waiting=3), runner)
    # 9-15 sequences: 16 seats; 2-8: the 8-seat program (8 tokens, the smallest rung); 1 alone
    assert runner.asked == [(16, 16, 16, 4), (8, 8, 16, 4), (1, 1, 16, 4)]
    drain.after_dispatch(prefill, queues(running=12, waiting=3), runner)
    drain.after_dispatch(prefill, queues(running=9, waiting=0), runner)   # nothing new
    assert len(runner.asked) == 3
    drain.after_dispatch(prefill, queues(running=40, waiting=0), runner)  # capped at 32
    assert runner.asked[3:] == [(32, 32, 16, 4), (24, 24, 16, 4)]  # 17-24: the 3/4 rung
    wider = builder.empty(64, 8, 8)                    # another block-table width
    drain.after_dispatch(wider, queues(running=1, waiting=0), runner)
    assert runner.asked[5:] == [(1, 1, 8, 4)]


def test_the_decode_being_dispatched_is_not_asked_for():
    kv = make_scheduler(num_blocks=64, block_size=4).kv
    builder = BatchBuilder(kv, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64)
    runner = RecordingRunner()
    drain = DrainPrograms(builder, num_steps=1, max_num_seqs=8)
    drain.after_dispatch(builder.empty(8, 8, 16), queues(running=8, waiting=0), runner)
    assert runner.asked == [(1, 1, 16, 1)]   # (8, 8, 16) is the call itself


def test_on_by_default_only_off_the_cpu():
    kv = make_scheduler(num_blocks=64, block_size=4).kv
    builder = BatchBuilder(kv, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64)
    auto = SchedulerConfig()
    assert DrainPrograms.for_config(auto, builder, RecordingRunner("cpu")) is None
    assert DrainPrograms.for_config(auto, builder, RecordingRunner("tpu")) is not None
    on = SchedulerConfig(compile_ahead=True)
    assert DrainPrograms.for_config(on, builder, RecordingRunner("cpu")) is not None
    off = SchedulerConfig(compile_ahead=False)
    assert DrainPrograms.for_config(off, builder, RecordingRunner("gpu")) is None
