"""Knowledge transfer: GEM → (domain FMs →) vertical models (ExFM-style; GEM's transfer).

    teacher.py   TeacherService: the frozen FM, once per example; user cache; Parquet cache; the snapshot
               a student of day d reads with transfer.snapshot_lag (teacher_snapshot); DailySnapshots
    user_reps.py the per-user tables published for serving: UserRepCache (mean), UserRepHistory (per day)
    stream.py    the students' rows (surfaces, history caps), scored once by the teacher
    losses.py    KD, auxiliary head (label scaling, weight), the loss of one student step
    adapter.py   the student adapter (stale teacher → calibrated on the freshest labels)
    share.py     parameter sharing (tables copied or PCA-projected from the teacher)
    trainer.py   students stepping on a shared stream; evaluation next to the teacher; transfer ratio
    distill.py   ``opengem distill`` (direct / --via), run directories
"""

from opengem.transfer.config import TransferConfig, techniques_config
from opengem.transfer.distill import distill
from opengem.transfer.teacher import (
    CachedTeacher,
    TeacherOutput,
    TeacherService,
    UserRepCache,
    teacher_snapshot,
)
from opengem.transfer.trainer import transfer_ratio

__all__ = ["CachedTeacher", "TeacherOutput", "TeacherService", "TransferConfig", "UserRepCache",
           "distill", "teacher_snapshot", "techniques_config", "transfer_ratio"]
