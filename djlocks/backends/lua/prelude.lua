-- Shared by every djlocks script; the script's own body follows.
-- KEYS[1] is the name's meta hash "<prefix>:{<name>}:m" (fields limit, fence,
-- name, ticket); every other key of the name shares its hash tag, so a
-- script touches one Redis Cluster slot. A slot's lease "s:<i>" is a string
-- with a TTL: "<token>\n<fence>\n<since ms>\n<identity JSON>[\n<run id>]";
-- a waiter's record "w:<id>" is "<channel>\n<since ms>\n<identity JSON>".
local meta = KEYS[1]
local base = string.sub(meta, 1, -2)
local queue = base .. 'q'

local function slot_key(i) return base .. 's:' .. i end
local function cool_key(i) return base .. 'c:' .. i end
local function waiter_key(id) return base .. 'w:' .. id end

-- Redis's own clock: milliseconds and microseconds since the epoch.
local function clock()
  local t = redis.call('TIME')
  local seconds, micros = tonumber(t[1]), tonumber(t[2])
  return seconds * 1000 + math.floor(micros / 1000), seconds * 1000000 + micros
end

local function limit_of() return tonumber(redis.call('HGET', meta, 'limit') or '0') end

-- The lease's value if token holds it, else nil.
local function held_by(key, token)
  local value = redis.call('GET', key)
  if value and string.sub(value, 1, #token + 1) == token .. '\n' then return value end
  return nil
end

-- Walk the queue in ticket order, dropping waiters whose record expired (a
-- dead process). Calls visit(id) for each live waiter until it returns true
-- or cap live waiters were passed; returns how many it passed.
local function walk_queue(visit, cap)
  local start, passed, dead, stopped = 0, 0, {}, false
  while not stopped and passed < cap do
    local ids = redis.call('ZRANGE', queue, start, start + 15)
    if #ids == 0 then break end
    for _, id in ipairs(ids) do
      if redis.call('EXISTS', waiter_key(id)) == 0 then
        dead[#dead + 1] = id
      elseif visit(id) then
        stopped = true
      else
        passed = passed + 1
      end
      if stopped or passed >= cap then break end
    end
    start = start + #ids
  end
  if #dead > 0 then redis.call('ZREM', queue, unpack(dead)) end
  return passed
end

-- Wake the first waiters, one per slot that has no holder (a cooling slot
-- too: its waiter learns how long the cool-down lasts). The wake-up is a
-- hint; every waiter also polls, so a lost message delays, never strands.
local function wake_heads()
  if redis.call('ZCARD', queue) == 0 then return end
  local unheld = 0
  for i = 0, limit_of() - 1 do
    if redis.call('EXISTS', slot_key(i)) == 0 then unheld = unheld + 1 end
  end
  walk_queue(function(id)
    local record = redis.call('GET', waiter_key(id))
    if record then redis.call('PUBLISH', string.match(record, '^[^\n]*'), id) end
    return false
  end, unheld)
end
