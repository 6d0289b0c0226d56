//! An intrusive doubly linked list over block indices.
//!
//! The links live in the blocks themselves (`Links`), so pushing, popping and
//! unlinking any block is O(1) and allocates nothing. A block is in at most
//! one list at a time; the pool keeps two: never-used / plainly free blocks,
//! and unreferenced cached blocks in least-recently-used order.

/// Marks "no block" in a link or a list end.
pub(crate) const NIL: u32 = u32::MAX;

/// The two links a block carries for whichever list currently holds it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Links {
    pub prev: u32,
    pub next: u32,
}

impl Links {
    pub const UNLINKED: Links = Links {
        prev: NIL,
        next: NIL,
    };
}

/// Head, tail and length of one list; the links are stored in a slice of
/// `Links` indexed by block id, passed to every operation.
#[derive(Clone, Debug)]
pub(crate) struct List {
    head: u32,
    tail: u32,
    len: usize,
}

impl List {
    /// An empty list.
    pub fn new() -> List {
        List {
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }

    /// Number of blocks in the list.
    pub fn len(&self) -> usize {
        self.len
    }

    /// The first block (the least recently pushed to the back), if any.
    pub fn front(&self) -> Option<u32> {
        (self.head != NIL).then_some(self.head)
    }

    /// Appends `id` at the back. `id` must not be in any list.
    pub fn push_back(&mut self, links: &mut [Links], id: u32) {
        let i = id as usize;
        links[i] = Links {
            prev: self.tail,
            next: NIL,
        };
        if self.tail == NIL {
            self.head = id;
        } else {
            links[self.tail as usize].next = id;
        }
        self.tail = id;
        self.len += 1;
    }

    /// Prepends `id` at the front. `id` must not be in any list.
    pub fn push_front(&mut self, links: &mut [Links], id: u32) {
        let i = id as usize;
        links[i] = Links {
            prev: NIL,
            next: self.head,
        };
        if self.head == NIL {
            self.tail = id;
        } else {
            links[self.head as usize].prev = id;
        }
        self.head = id;
        self.len += 1;
    }

    /// Unlinks `id`, which must be in this list.
    pub fn remove(&mut self, links: &mut [Links], id: u32) {
        let Links { prev, next } = links[id as usize];
        if prev == NIL {
            self.head = next;
        } else {
            links[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            links[next as usize].prev = prev;
        }
        links[id as usize] = Links::UNLINKED;
        self.len -= 1;
    }

    /// Unlinks and returns the first block, if any.
    pub fn pop_front(&mut self, links: &mut [Links]) -> Option<u32> {
        let id = self.front()?;
        self.remove(links, id);
        Some(id)
    }

    /// Block ids from front to back (for tests and invariant checks).
    #[cfg(test)]
    pub fn ids(&self, links: &[Links]) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.len);
        let mut cur = self.head;
        while cur != NIL {
            out.push(cur);
            cur = links[cur as usize].next;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn push_pop_remove_keep_order() {
        let mut links = vec![Links::UNLINKED; 6];
        let mut list = List::new();
        for id in [3, 1, 4] {
            list.push_back(&mut links, id);
        }
        list.push_front(&mut links, 5);
        assert_eq!(list.ids(&links), vec![5, 3, 1, 4]);
        list.remove(&mut links, 1);
        assert_eq!(list.ids(&links), vec![5, 3, 4]);
        list.remove(&mut links, 4);
        assert_eq!(list.ids(&links), vec![5, 3]);
        assert_eq!(list.pop_front(&mut links), Some(5));
        assert_eq!(list.pop_front(&mut links), Some(3));
        assert_eq!(list.pop_front(&mut links), None);
        assert_eq!(list.len(), 0);
        list.push_back(&mut links, 2);
        assert_eq!(list.ids(&links), vec![2]);
        assert_eq!(list.front(), Some(2));
    }
}
