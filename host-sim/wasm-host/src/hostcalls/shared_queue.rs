//! Shared queues: registration (last registrant wins), resolution by vm_id and name, and enqueues
//! that post an `on_queue_ready` for the embedder to deliver.

use super::{count, fault, give, read, read_str, st, write_u32, C, ENV, S_OK};
use crate::abi::Status;
use crate::state::{QueuePost, SharedQueue, VmState};
use wasmtime::{Linker, Result};

/// Adds this group's host functions to `linker`.
pub fn add_to_linker(l: &mut Linker<VmState>) -> Result<()> {
    l.func_wrap(ENV, "proxy_register_shared_queue", |mut c: C<'_>, np: i32, nn: i32, out: i32| -> Result<i32> {
        count(&c, "proxy_register_shared_queue");
        fault(&c, "proxy_register_shared_queue")?;
        let name = tri!(read_str(&mut c, np, nn));
        let (vm, root) = (c.data().vm, c.data().root_id);
        let id = {
            let mut p = c.data().proc.borrow_mut();
            let key = (p.vm_id.clone(), name.clone());
            match p.queue_names.get(&key).copied() {
                Some(id) => {
                    // Last registrant wins; pending items stay.
                    let q = p.queues.get_mut(&id).expect("queue index out of sync");
                    q.owner_vm = vm;
                    q.owner_context = root;
                    id
                }
                None => {
                    p.next_queue += 1;
                    let id = p.next_queue;
                    p.queues.insert(id, SharedQueue { owner_vm: vm, owner_context: root, items: Default::default() });
                    p.queue_names.insert(key, id);
                    id
                }
            }
        };
        tri!(write_u32(&mut c, out, id));
        Ok(S_OK)
    })?;
    l.func_wrap(
        ENV,
        "proxy_resolve_shared_queue",
        |mut c: C<'_>, vp: i32, vn: i32, np: i32, nn: i32, out: i32| -> Result<i32> {
            count(&c, "proxy_resolve_shared_queue");
            fault(&c, "proxy_resolve_shared_queue")?;
            let vm_id = tri!(read_str(&mut c, vp, vn));
            let name = tri!(read_str(&mut c, np, nn));
            let id = c.data().proc.borrow().queue_names.get(&(vm_id, name)).copied();
            let Some(id) = id else {
                return Ok(st(Status::NotFound));
            };
            tri!(write_u32(&mut c, out, id));
            Ok(S_OK)
        },
    )?;
    l.func_wrap(ENV, "proxy_dequeue_shared_queue", |mut c: C<'_>, id: i32, pp: i32, sp: i32| -> Result<i32> {
        count(&c, "proxy_dequeue_shared_queue");
        fault(&c, "proxy_dequeue_shared_queue")?;
        let item = {
            let mut p = c.data().proc.borrow_mut();
            let Some(q) = p.queues.get_mut(&(id as u32)) else {
                return Ok(st(Status::NotFound));
            };
            q.items.pop_front()
        };
        match item {
            Some(v) => give(&mut c, &v, pp, sp),
            None => Ok(st(Status::Empty)),
        }
    })?;
    l.func_wrap(ENV, "proxy_enqueue_shared_queue", |mut c: C<'_>, id: i32, vp: i32, vn: i32| -> Result<i32> {
        count(&c, "proxy_enqueue_shared_queue");
        fault(&c, "proxy_enqueue_shared_queue")?;
        let value = tri!(read(&mut c, vp, vn));
        let mut p = c.data().proc.borrow_mut();
        let Some(q) = p.queues.get_mut(&(id as u32)) else {
            return Ok(st(Status::NotFound));
        };
        q.items.push_back(value);
        let post = QueuePost { vm: q.owner_vm, context_id: q.owner_context, queue_id: id as u32 };
        p.posts.push(post);
        Ok(S_OK)
    })?;

    Ok(())
}
