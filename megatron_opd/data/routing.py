"""Which teacher scores a record's samples (``teachers.*``): the record's ``data.teacher_key`` field, else
``data.default_teacher``. Every record is checked when the files are read, so a bad one stops the run before any
model is built, naming its file and record."""

from __future__ import annotations

from typing import Any

from megatron_opd.data.records import DataError


class TeacherRouter:
    """``router(record)`` -> the name of the teacher of its samples; a record that names none, or an unknown one,
    is refused with ``where`` (file and record) and the known names."""

    def __init__(self, names: list[str], key: str = "teacher", default: str | None = None) -> None:
        self.names, self.key, self.default = list(names), key, default

    def __call__(self, record: dict[str, Any], where: str = "a record") -> str:
        name = record.get(self.key)
        if name is None:
            if self.default is None:
                raise DataError(
                    f"{where} has no {self.key!r} field naming its teacher (one of {self.names}): add it, or set "
                    "data.default_teacher for records without one"
                )
            return self.default
        if not isinstance(name, str) or name not in self.names:
            raise DataError(
                f"{where}: {self.key}={name!r} is none of the teachers {self.names} (teachers.NAME in the config)"
            )
        return name

    def check_files(self, paths: list[str], key: str) -> dict[str, int]:
        """Route every record of ``paths`` (``key``: the config key listing them); records per teacher."""
        from megatron_opd.data.records import read_record_files

        counts = dict.fromkeys(self.names, 0)
        for path, records in read_record_files(paths, key):
            for i, record in enumerate(records):
                counts[self(record, f"{key}: {path} record {i}")] += 1
        return counts

    @classmethod
    def of(cls, cfg) -> TeacherRouter | None:
        """The router of a ``TrainConfig`` (None in the one-teacher form)."""
        if not cfg.teachers:
            return None
        return cls(list(cfg.teachers), cfg.data.teacher_key, cfg.data.default_teacher)
