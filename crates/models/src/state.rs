//! Everything one sequence carries between forward calls.
//!
//! Owns: [`SeqState`] (the KV cache plus any architecture-specific state: recurrent
//! state of linear-attention layers, compressed KV rows, compressor carry) and
//! [`Snapshot`], a copy of that state at a token boundary. Prefix reuse restores a
//! snapshot instead of truncating, so state that cannot be truncated (recurrent, compressed)
//! is covered the same way as plain KV rows.

use std::any::Any;

use crate::kv::KvCache;

/// Per-sequence state an architecture keeps besides the KV cache.
pub trait ExtraState: Send + Sync {
    /// A deep copy (for snapshots).
    fn clone_box(&self) -> Box<dyn ExtraState>;
    /// Forget everything (a new sequence).
    fn clear(&mut self);
    /// Downcast support for the architecture that owns it.
    fn as_any_mut(&mut self) -> &mut dyn Any;
    /// Append every value to `e` (a snapshot kept on disk); false when this state has no
    /// byte form (then the snapshot stays in RAM only).
    fn encode(&self, _e: &mut crate::state_codec::Enc<'_>) -> bool {
        false
    }
    /// Read what [`ExtraState::encode`] wrote into this fresh state of the same model,
    /// checking every part against it.
    fn decode(
        &mut self,
        _d: &mut crate::state_codec::Dec<'_>,
    ) -> Result<(), crate::state_codec::DecodeError> {
        Err(crate::state_codec::DecodeError(
            "this architecture state has no byte form".into(),
        ))
    }
}

/// `extra` as the architecture state `T` (taken from `SeqState::extra`, so the KV cache
/// stays borrowable), or an error naming `arch` when the sequence was made by another model.
pub fn extra_as<'a, T: 'static>(
    extra: &'a mut Option<Box<dyn ExtraState>>,
    arch: &str,
) -> Result<&'a mut T, crate::ModelError> {
    extra
        .as_mut()
        .and_then(|x| x.as_any_mut().downcast_mut::<T>())
        .ok_or_else(|| {
            crate::ModelError::Compute(format!("{arch}: sequence state of another model"))
        })
}

/// The state of one sequence.
pub struct SeqState {
    pub kv: KvCache,
    /// Architecture-specific state (None for plain transformer architectures).
    pub extra: Option<Box<dyn ExtraState>>,
    /// A device backend's copy of the sequence (e.g. its KV cache in VRAM), made by
    /// [`crate::plan::DeviceForward`] on first use. Indexed by position like the KV
    /// cache, so truncation needs nothing from it.
    pub device: Option<Box<dyn ExtraState>>,
}

/// A copy of a [`SeqState`] at a token boundary.
pub struct Snapshot {
    pub(crate) kv: KvCache,
    pub(crate) extra: Option<Box<dyn ExtraState>>,
    pub(crate) device: Option<Box<dyn ExtraState>>,
}

impl Snapshot {
    /// Positions the snapshot covers.
    pub fn len(&self) -> usize {
        self.kv.len()
    }

    pub fn is_empty(&self) -> bool {
        self.kv.is_empty()
    }
}

impl SeqState {
    pub fn new(kv: KvCache) -> SeqState {
        SeqState {
            kv,
            extra: None,
            device: None,
        }
    }

    /// Positions evaluated so far.
    pub fn len(&self) -> usize {
        self.kv.len()
    }

    pub fn is_empty(&self) -> bool {
        self.kv.is_empty()
    }

    /// The most positions this sequence accepts.
    pub fn n_ctx(&self) -> usize {
        self.kv.n_ctx()
    }

    /// Forget every position (start a new sequence).
    pub fn clear(&mut self) {
        self.kv.clear();
        if let Some(e) = &mut self.extra {
            e.clear();
        }
        if let Some(e) = &mut self.device {
            e.clear();
        }
    }

    /// Copy the state as it is now (at a token boundary).
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            kv: self.kv.clone(),
            extra: self.extra.as_ref().map(|e| e.clone_box()),
            device: self.device.as_ref().map(|e| e.clone_box()),
        }
    }

    /// Return to a snapshot taken from a sequence of the same model.
    pub fn restore(&mut self, snap: &Snapshot) {
        self.kv = snap.kv.clone();
        self.extra = snap.extra.as_ref().map(|e| e.clone_box());
        self.device = snap.device.as_ref().map(|e| e.clone_box());
    }

    /// Drop positions from `len` on, when the state allows it (plain KV rows do; recurrent
    /// state does not: restore a snapshot instead). Returns whether it truncated.
    pub fn truncate(&mut self, len: usize) -> bool {
        if self.extra.is_some() && len < self.kv.len() {
            return false;
        }
        self.kv.truncate(len);
        true
    }
}
