//! The scheduler's side of a disaggregated request: destination pages reserved for a prompt
//! that a prefill worker computes, the request resumed on them once its state has arrived, and
//! the source pages of a handoff released after the transfer.

use crate::error::{EngineError, Result};
use crate::kv::KvError;
use crate::sampler::Sampler;

use super::super::paged::PagedSeq;
use super::super::request::{EngineEvent, EngineRequest, EventSink, FinishReason, Reservation};
use super::{Scheduler, Seq};

impl Scheduler {
    /// Reserves destination pages for a `prompt_len`-token prompt arriving from a prefill
    /// worker: the MLA pages covering it and one state page per KDA group, all zeroed.
    pub fn reserve(&mut self, prompt_len: usize) -> Result<Reservation> {
        if prompt_len == 0 {
            return Err(EngineError::InvalidInput(
                "cannot reserve pages for an empty prompt".into(),
            ));
        }
        let mut seq = PagedSeq::new(&self.slots);
        let reserved = loop {
            match seq.reserve(&self.slots, &mut self.pool, prompt_len) {
                Ok(r) => break r,
                Err(KvError::OutOfPages(_)) => {
                    let need = seq.pages_needed(&self.slots, &self.pool, prompt_len).max(1);
                    if self.index.evict(&mut self.pool, need)? == 0 {
                        seq.release_all(&mut self.pool)?;
                        return Err(KvError::OutOfPages(
                            self.pool.layout().group_ids().next().expect("a group"),
                        )
                        .into());
                    }
                }
                Err(e) => return Err(e.into()),
            }
        };
        seq.adopt(reserved);
        seq.len = prompt_len;
        let id = self.next_id;
        self.next_id += 1;
        let r = Reservation {
            id,
            prompt_len,
            mla_pages: seq.mla_pages.clone(),
            kda_pages: seq.kda_pages.clone(),
        };
        self.reservations.insert(id, seq);
        Ok(r)
    }

    /// Frees a reservation whose transfer was abandoned.
    pub fn cancel_reservation(&mut self, id: u64) -> Result<bool> {
        match self.reservations.remove(&id) {
            Some(mut seq) => {
                seq.release_all(&mut self.pool)?;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// Continues a request whose prompt state was written into reservation `id`, after the
    /// prefill worker sampled `first_token` (already delivered to the client).
    pub fn submit_resumed(
        &mut self,
        id: u64,
        req: EngineRequest,
        first_token: u32,
        cached_tokens: usize,
        mut sink: Box<dyn EventSink>,
    ) -> Result<()> {
        let paged = self
            .reservations
            .remove(&id)
            .ok_or_else(|| EngineError::InvalidInput(format!("no reservation {id}")))?;
        if paged.len != req.prompt.len() {
            let mut paged = paged;
            paged.release_all(&mut self.pool)?;
            return Err(EngineError::InvalidInput(
                "the reservation was made for another prompt length".into(),
            ));
        }
        if let Err(e) = self.check_images(&req) {
            let mut paged = paged;
            paged.release_all(&mut self.pool)?;
            return Err(EngineError::InvalidInput(e));
        }
        let mut sampler = Sampler::new(req.sampling.clone())?;
        // The first token (and any resumed ones) were drawn elsewhere.
        sampler.skip(1 + req.resumed_tokens);
        let mut tokens = req.prompt.clone();
        tokens.push(first_token);
        let done = req.stop_ids.contains(&first_token) || req.max_new_tokens <= 1;
        let marks = self.marks(id, &req);
        let mut seq = Seq {
            id,
            tokens,
            recomputable: !req.images.is_empty() || marks.is_empty(),
            marks,
            req,
            paged,
            sampler,
            cached_tokens,
            indexed_pages: 0,
            logprobs: None,
            sink: Box::new(|_: EngineEvent| true),
        };
        if done {
            sink.send(EngineEvent::Finished {
                reason: if seq.req.stop_ids.contains(&first_token) {
                    FinishReason::Stop
                } else {
                    FinishReason::Length
                },
                prompt_tokens: seq.req.prompt.len(),
                completion_tokens: 1,
                cached_tokens,
            });
            seq.paged.release_all(&mut self.pool)?;
            return Ok(());
        }
        seq.sink = sink;
        self.running.push(seq);
        Ok(())
    }

    /// Releases the pages of a finished handoff (after the transfer, or when it was abandoned).
    pub fn release_handoff(&mut self, id: u64) -> Result<bool> {
        match self.handoffs.remove(&id) {
            Some(mut seq) => {
                seq.release_all(&mut self.pool)?;
                Ok(true)
            }
            None => Ok(false),
        }
    }
}
